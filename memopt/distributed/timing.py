"""Step time of data-parallel sharding and offload: collectives, host traffic, the CPU optimizer, overlap.

Pure functions of plain numbers and a ``HardwareSpec``. The compute time of forward and backward per
unit comes from memopt's single-GPU estimate (a rank runs the same micro-batch as one GPU would); this
module adds what sharding costs and how the engines hide it:

* collectives are bandwidth-bound rings: an all-gather or reduce-scatter of a ``B``-byte (unsharded)
  buffer over ``n`` ranks moves ``(n-1)/n * B`` through each rank's link, an all-reduce twice that,
  plus a per-step latency (``TimingParams.latency_s`` per ring step);
* the link is NVLink (``intra_node_bandwidth``) inside a node, the network (``inter_node_bandwidth``,
  per GPU as the shipped specs give it) when the group spans nodes, PCIe (``host_link_bandwidth``) when
  the spec has no NVLink figure;
* offload moves bytes over the host link (``host_link_bandwidth`` x ``TimingParams.host_link_efficiency``);
* the CPU optimizer (DeepSpeed CPUAdam, or torch's AdamW on CPU for FSDP2 offload) is bound by the host
  memory bandwidth: ``bytes_touched_per_param x params / (host_memory_bandwidth x efficiency)``, with all
  ranks of a node sharing the node's bandwidth. CPUAdam touches ~30 B per parameter (reads fp32 param,
  grad, m, v; writes param, m, v and the 16-bit copy). Host memory bandwidth is not in the shipped
  hardware specs: ``hw.extra["host_memory_bandwidth"]`` or ``TimingParams.host_memory_bandwidth``
  (200 GB/s: a two-socket DDR5 server's STREAM-class figure, an assumption to calibrate);
* NVMe reads and writes at ``TimingParams.nvme_read_bandwidth`` / ``nvme_write_bandwidth`` per node
  (``hw.extra`` overrides; defaults: one PCIe Gen4 x4 SSD, 6 / 4 GB/s — an assumption to calibrate).

* the engines' fixed work per micro-batch (hooks, per-parameter fetch/release and gradient hand-off,
  launches) is charged per parameter tensor and micro-batch, not overlapped: ``TimingParams``'
  ``deepspeed_tensor_overhead_s`` (2.04 ms at ZeRO-3: DeepSpeed's per-parameter Python work), at ZeRO-1/2
  ``deepspeed_z12_tensor_overhead_s`` (0.43 ms) plus ``deepspeed_z12_param_overhead_s`` per parameter of the
  rank's partition, and ``fsdp2_tensor_overhead_s`` (0.31 ms), fitted to the H200 rows of ``benchmarks/sharding``
  (refitted once each pass takes at least the host's time to issue its ops: ``scripts/fit_engine_overhead.py``);
* FSDP2 with ``CPUOffloadPolicy`` accumulates gradients on the host from the second micro-batch on, a
  synchronous copy and a CPU add per unit (``fsdp2_offload_grad_accumulate_bandwidth``, 1.9 GB/s of fp32
  gradient shard, fitted to the one-GPU FSDP2 offload rows): each extra micro-batch costs a pass over all
  gradients on the host.

Overlap, as the engines do it:

* FSDP2: the all-gather of the next unit runs while the current one computes (``prefetch``); in
  backward the reduce-scatter of a unit's gradients and the all-gather of the previous unit share the
  communication stream while the current unit's backward runs. Exposed: the first all-gather, and per
  unit whatever communication exceeds its compute. With CPU offload the host-to-device copy of a unit's
  shard precedes its all-gather on the same path, the gradient shard's copy back follows its
  reduce-scatter, and the optimizer step runs on the CPU after backward (not overlapped).
* DeepSpeed ZeRO-1/2: gradient reduction overlaps backward (``overlap_comm``); the parameter
  all-gather after the step does not. ZeRO-3 gathers parameters with prefetch as FSDP2 does.
  ZeRO-Offload overlaps the gradient copies to the host with backward; CPUAdam and the copy of the
  updated 16-bit parameters back to the GPU follow the backward pass (DeepSpeed's "delayed parameter
  update", which would overlap them with the next step, is off by default).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from memopt.estimate.timing import DEFAULT_TIMING, TimingModel, pass_time
from memopt.hardware import HardwareSpec

__all__ = [
    "ShardedTime",
    "TimingParams",
    "all_gather_time",
    "all_reduce_time",
    "collective_bandwidth",
    "cpu_optimizer_time",
    "engine_overhead_time",
    "host_transfer_time",
    "nvme_time",
    "nvme_traffic",
    "overlapped_pass",
    "reduce_scatter_time",
    "sharded_step_time",
]


@dataclass(frozen=True)
class TimingParams:
    """Efficiencies and the figures the hardware specs do not carry (assumptions, to calibrate on a GPU host)."""

    collective_efficiency: float = 0.80  # achieved fraction of link bandwidth by NCCL rings at large sizes
    latency_s: float = 10e-6  # per ring step
    host_link_efficiency: float = 0.85  # as memopt's activation-offload model
    host_memory_bandwidth: float = 200e9  # bytes/s per node
    cpu_optimizer_efficiency: float = 0.5  # DeepSpeed CPUAdam: fraction of host memory bandwidth
    torch_cpu_optimizer_efficiency: float = 0.1  # torch AdamW on CPU (DeepSpeed: CPUAdam is 5-7x faster)
    cpu_adam_bytes_per_param: int = 30
    nvme_read_bandwidth: float = 6e9
    nvme_write_bandwidth: float = 4e9
    # The engines' fixed work per micro-batch, per parameter tensor of the model, not hidden behind compute
    # (Python hooks, per-parameter fetch/release and gradient hand-off, small copies and launches).
    # DeepSpeed: fitted by ``scripts/fit_engine_overhead.py`` (benchmarks/sharding/engine_overhead_fit.md) to the 12
    # one-H200 offload rows memopt.wrap applied (torch 2.11, DeepSpeed 0.19.8; Llama-3.2-3B/1B, Qwen2.5-0.5B,
    # Qwen2-1.5B), with each pass taking at least the host's time to issue its ops: ZeRO-3 2.04 ms per tensor
    # (in-sample within 14%, the spread of repeated runs; the two-GPU ZeRO-3 rows of session 5 showed 1.95 ms);
    # ZeRO-1/2 0.43 ms per tensor plus 0.0666 s per 1e9 parameters (its gradient hand-off to the host buffers
    # scales with the bytes: in-sample within 4%). Before the host floor: 2.13 ms, 0.62 ms and 0.0605 s.
    # FSDP2 (two rows on 2 GPUs, +0.153 s at 2 micro-batches, +0.094 s at 1): 0.31 ms per tensor.
    deepspeed_tensor_overhead_s: float = 2.04e-3
    deepspeed_z12_tensor_overhead_s: float = 0.4296e-3
    deepspeed_z12_param_overhead_s: float = 0.0666e-9
    fsdp2_tensor_overhead_s: float = 0.31e-3
    # FSDP2 with CPUOffloadPolicy accumulates gradients on the host: from the second micro-batch on, each unit's
    # reduce-scattered fp32 gradient shard is copied to the host synchronously (``non_blocking`` only when not
    # accumulating: torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py ``foreach_reduce``, into fresh
    # pageable memory) and added to the shard's gradient on the CPU, both on the thread that drives backward.
    # Bytes of gradient shard per second, fitted to the two one-GPU FSDP2 offload rows (12.8 s at 2
    # micro-batches, 28.7 s at 4): 6.7 s per accumulated micro-batch for 12.85 GB of fp32 shards.
    fsdp2_offload_grad_accumulate_bandwidth: float = 1.9e9


DEFAULT_PARAMS = TimingParams()


def collective_bandwidth(hw: HardwareSpec, group_size: int, *, spans_nodes: bool) -> float:
    """Bytes/s one rank's ring link carries for a group of ``group_size`` ranks."""
    if group_size <= 1:
        return float("inf")
    if spans_nodes:
        bw = hw.inter_node_bandwidth or hw.host_link_bandwidth
    else:
        bw = hw.intra_node_bandwidth or hw.host_link_bandwidth
    if bw <= 0:
        raise ValueError(f"hardware {hw.name!r} has no link bandwidth for collectives; set intra_node_bandwidth / "
                         "inter_node_bandwidth in its spec")
    return bw


def all_gather_time(nbytes: float, n: int, bandwidth: float, tp: TimingParams = DEFAULT_PARAMS) -> float:
    """Ring all-gather producing ``nbytes`` (the unsharded buffer) on each of ``n`` ranks."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) / n * nbytes / (bandwidth * tp.collective_efficiency) + (n - 1) * tp.latency_s


def reduce_scatter_time(nbytes: float, n: int, bandwidth: float, tp: TimingParams = DEFAULT_PARAMS) -> float:
    """Ring reduce-scatter of an ``nbytes`` input on each of ``n`` ranks (same traffic as all-gather)."""
    return all_gather_time(nbytes, n, bandwidth, tp)


def all_reduce_time(nbytes: float, n: int, bandwidth: float, tp: TimingParams = DEFAULT_PARAMS) -> float:
    """Ring all-reduce: a reduce-scatter then an all-gather."""
    return 2 * all_gather_time(nbytes, n, bandwidth, tp)


def host_transfer_time(nbytes: float, hw: HardwareSpec, tp: TimingParams = DEFAULT_PARAMS) -> float:
    """One direction over the GPU's host link (pinned memory)."""
    if nbytes <= 0:
        return 0.0
    return nbytes / (hw.host_link_bandwidth * tp.host_link_efficiency)


def cpu_optimizer_time(params_per_rank: int, ranks_per_node: int, hw: HardwareSpec | None = None,
                       tp: TimingParams = DEFAULT_PARAMS, *, deepspeed_cpu_adam: bool = True) -> float:
    """Seconds of an Adam step on the host for ``params_per_rank`` fp32 parameters on each rank of a node."""
    bw = float((hw.extra or {}).get("host_memory_bandwidth", tp.host_memory_bandwidth)) if hw else \
        tp.host_memory_bandwidth
    eff = tp.cpu_optimizer_efficiency if deepspeed_cpu_adam else tp.torch_cpu_optimizer_efficiency
    return params_per_rank * ranks_per_node * tp.cpu_adam_bytes_per_param / (bw * eff)


def nvme_traffic(params: int, *, optimizer: bool, param_bytes: int = 0, param_reads: int = 0) -> tuple[int, int]:
    """Bytes read and written on a node's NVMe in one step (ZeRO-Infinity), for ``params`` parameters there.

    Optimizer on NVMe: the fp32 master weights and Adam's two states are read and written back (12 B/param each
    way), and the fp32 gradients are written and read back (4 B/param each way; ``test_nvme_offload`` counts the
    files). Parameters on NVMe (``param_bytes`` each): read again for every gathered pass (``param_reads``:
    forward and, when resharded, backward, per micro-batch) and written once after the update. On the H200
    (qwen25_0_5b, raw/session6_nvme) the swap files held 8.859 GB, each rewritten once a step; this counts 8.893 GB
    written a step."""
    read = write = 16 * params if optimizer else 0
    if param_bytes:
        read += param_bytes * params * param_reads
        write += param_bytes * params
    return read, write


def nvme_time(read_bytes: float, write_bytes: float, hw: HardwareSpec | None = None,
              tp: TimingParams = DEFAULT_PARAMS) -> float:
    """Seconds to read and write the given bytes per node on NVMe (reads and writes not overlapped)."""
    extra = (hw.extra or {}) if hw else {}
    r = float(extra.get("nvme_read_bandwidth", tp.nvme_read_bandwidth))
    w = float(extra.get("nvme_write_bandwidth", tp.nvme_write_bandwidth))
    return read_bytes / r + write_bytes / w


def overlapped_pass(compute_s: Sequence[float], comm_s: Sequence[float], *, prefetch: int = 1) -> float:
    """A pass over units where unit ``i``'s communication must finish before it computes.

    With ``prefetch >= 1`` the communication of unit ``i + 1`` runs while unit ``i`` computes (one
    communication stream, one compute stream): the pass takes the first unit's communication, then per
    unit the longer of its compute and the next unit's communication. Without prefetch nothing overlaps.
    """
    if not compute_s:
        return 0.0
    if prefetch <= 0:
        return sum(compute_s) + sum(comm_s)
    comm_free = comp_free = 0.0
    comp_done: list[float] = []
    for i, (comp, comm) in enumerate(zip(compute_s, comm_s)):
        # at most 1 + prefetch units hold gathered buffers: unit i's gather waits for unit i - prefetch - 1
        j = i - prefetch - 1
        gate = comp_done[j] if j >= 0 else 0.0
        comm_free = max(comm_free, gate) + comm
        comp_free = max(comp_free, comm_free) + comp
        comp_done.append(comp_free)
    return comp_free


@dataclass
class ShardedTime:
    """A sharded step's time and its parts (seconds)."""

    step_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    exposed_comm_s: float
    comm_s: float  # total communication (hidden or not)
    host_transfer_s: float
    cpu_optimizer_s: float
    nvme_s: float
    engine_overhead_s: float = 0.0  # the engine's fixed work per micro-batch and tensor, all micro-batches
    host_grad_accumulate_s: float = 0.0  # FSDP2 + CPU offload: gradient accumulation on the host
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"step_s": self.step_s, "forward_s": self.forward_s, "backward_s": self.backward_s,
                "optimizer_s": self.optimizer_s, "exposed_comm_s": self.exposed_comm_s, "comm_s": self.comm_s,
                "host_transfer_s": self.host_transfer_s, "cpu_optimizer_s": self.cpu_optimizer_s,
                "nvme_s": self.nvme_s, "engine_overhead_s": self.engine_overhead_s,
                "host_grad_accumulate_s": self.host_grad_accumulate_s, **self.detail}


def engine_overhead_time(engine: str, param_tensors: int, micro_batches: int,
                         tp: TimingParams = DEFAULT_PARAMS, *, stage: int = 3, params: int = 0) -> float:
    """The engine's fixed work over ``micro_batches`` micro-batches of a model of ``param_tensors`` tensors
    (``params`` elements; DeepSpeed ZeRO-1/2's share per parameter)."""
    if param_tensors <= 0:
        return 0.0
    if engine == "deepspeed" and stage in (1, 2):
        per_micro = tp.deepspeed_z12_tensor_overhead_s * param_tensors + tp.deepspeed_z12_param_overhead_s * params
    else:
        per_tensor = {"deepspeed": tp.deepspeed_tensor_overhead_s, "fsdp2": tp.fsdp2_tensor_overhead_s}.get(engine,
                                                                                                           0.0)
        per_micro = per_tensor * param_tensors
    return per_micro * max(1, micro_batches)


def _host_detail(gpu_pass_s: float, host_issue_s: float, micro_batches: int) -> dict[str, float]:
    """The host's share of the passes, as the single-GPU clock reports it (``host_s`` over all micro-batches)."""
    if not host_issue_s:
        return {}
    return {"host_s": host_issue_s * micro_batches, "host_bound": float(host_issue_s > gpu_pass_s)}


def sharded_step_time(*, engine: str, stage: int, world_size: int, nodes: int, hw: HardwareSpec,
                      unit_params: Sequence[int], forward_s: Sequence[float], backward_s: Sequence[float],
                      optimizer_s: float, compute_bytes: int = 2, param_bytes: int = 4, reduce_bytes: int = 4,
                      root_params: int = 0, root_forward_s: float = 0.0, root_backward_s: float = 0.0,
                      micro_batches: int = 1, replicate_size: int = 1, offload_optimizer: str = "none",
                      offload_params: str = "none", prefetch: int = 1, reshard_after_forward: bool = True,
                      param_tensors: int = 0, tp: TimingParams = DEFAULT_PARAMS, host_issue_s: float = 0.0,
                      tm: TimingModel = DEFAULT_TIMING) -> ShardedTime:
    """Step time of one rank: ``micro_batches`` forward/backward passes over the units, then the update.

    ``unit_params[i]``, ``forward_s[i]``, ``backward_s[i]``: parameters and single-GPU compute seconds
    of unit ``i`` (the blocks, in forward order) for one micro-batch; ``root_*``: the rest of the model
    (embeddings, head, loss), gathered first and reduced last. ``optimizer_s``: the single-GPU optimizer
    time over all parameters (sharding divides it by the shard group's size; CPU offload replaces it by
    the CPU optimizer). Byte sizes per element: ``compute_bytes`` (gathered params), ``param_bytes``
    (stored shards, what CPU offload copies in), ``reduce_bytes`` (gradient reduction). ``param_tensors``:
    the model's parameter tensors, for the engine's fixed work per micro-batch (``engine_overhead_time``;
    0 leaves it out). ``host_issue_s``: the host seconds to issue one micro-batch pass's kernels (the single-GPU
    clock's ``host_s`` per micro-batch): each rank's host issues its own pass, so a pass takes the longer of it and
    the GPU's (:func:`memopt.estimate.timing.pass_time` with ``tm``), as on one GPU; 0 leaves it out.
    """
    if len(unit_params) != len(forward_s) or len(unit_params) != len(backward_s):
        raise ValueError("unit_params, forward_s and backward_s need one entry per unit")
    n_world = world_size
    shard = world_size // max(1, replicate_size)
    per_node = world_size // max(1, nodes)
    spans = nodes > 1 and shard > per_node
    bw = collective_bandwidth(hw, shard, spans_nodes=spans)
    units = list(unit_params) + ([root_params] if root_params else [])
    fwd_c = list(forward_s) + ([root_forward_s] if root_params else [])
    bwd_c = list(backward_s) + ([root_backward_s] if root_params else [])
    # root first in forward, last in backward
    if root_params:
        units = [units[-1], *units[:-1]]
        fwd_c = [fwd_c[-1], *fwd_c[:-1]]
        bwd_c = [bwd_c[-1], *bwd_c[:-1]]
    total_params = sum(units)
    offload_cpu = offload_params != "none" or (engine == "fsdp2" and offload_optimizer != "none")
    comm_total = 0.0
    host_s = 0.0
    detail: dict[str, Any] = {"link_bandwidth": bw, "shard_size": shard}
    if engine == "ddp" or (stage in (0, 1, 2) and engine != "fsdp2"):
        # gradients reduced during backward (buckets), parameters all-gathered after the step (ZeRO-1/2)
        red_total = total_params * reduce_bytes
        if stage == 0 or engine == "ddp":
            red = all_reduce_time(red_total, n_world, bw, tp)
            gather = 0.0
        else:
            red = reduce_scatter_time(red_total, shard, bw, tp)
            gather = all_gather_time(total_params * compute_bytes, shard, bw, tp)
        fwd = sum(fwd_c)
        bwd_compute = sum(bwd_c)
        # the last bucket's reduction is exposed; the rest overlaps backward
        last_bucket = red / max(1, len(units))
        bwd = max(bwd_compute, red - last_bucket) + last_bucket
        per_micro = pass_time(fwd + bwd, host_issue_s, tm)
        # ZeRO-1 reduces once per step (at the boundary); ZeRO-2/DDP per micro-batch unless no_sync
        comm_total = red * micro_batches + gather
        passes = per_micro * micro_batches
        exposed = (bwd - bwd_compute) * micro_batches + gather
        opt, cpu_opt, nvme = optimizer_s / max(1, shard if stage >= 1 else 1), 0.0, 0.0
        if offload_optimizer != "none":
            p_rank = -(-total_params // shard)
            d2h = host_transfer_time(p_rank * reduce_bytes, hw, tp)  # overlapped with backward
            h2d = host_transfer_time(p_rank * compute_bytes, hw, tp)  # updated 16-bit params back
            cpu_opt = cpu_optimizer_time(p_rank, per_node, hw, tp, deepspeed_cpu_adam=True)
            if offload_optimizer == "nvme":
                nvme = nvme_time(*nvme_traffic(p_rank * per_node, optimizer=True), hw, tp)
            host_s = d2h + h2d
            opt = cpu_opt + h2d + nvme + max(0.0, d2h - bwd_compute)
        overhead = engine_overhead_time(engine, param_tensors, micro_batches, tp, stage=stage,
                                        params=-(-total_params // shard))
        step = passes + opt + gather + overhead
        detail.update(_host_detail(fwd + bwd, host_issue_s, micro_batches))
        return ShardedTime(step_s=step, forward_s=fwd * micro_batches, backward_s=bwd * micro_batches,
                           optimizer_s=opt, exposed_comm_s=exposed, comm_s=comm_total, host_transfer_s=host_s,
                           cpu_optimizer_s=cpu_opt, nvme_s=nvme, engine_overhead_s=overhead, detail=detail)
    # stage 3 (FSDP2, DeepSpeed ZeRO-3): gather per unit in forward and backward, reduce-scatter per unit
    ag = [all_gather_time(u * compute_bytes, shard, bw, tp) for u in units]
    rs = [reduce_scatter_time(u * reduce_bytes, shard, bw, tp) for u in units]
    h2d = [host_transfer_time(-(-u // shard) * param_bytes, hw, tp) if offload_cpu else 0.0 for u in units]
    d2h = [host_transfer_time(-(-u // shard) * reduce_bytes, hw, tp) if offload_cpu else 0.0 for u in units]
    fwd = overlapped_pass(fwd_c, [a + h for a, h in zip(ag, h2d)], prefetch=prefetch)
    # backward in reverse order: gather unit i (again, if resharded; the root never is), reduce-scatter it after
    order = list(range(len(units)))[::-1]
    b_comp = [bwd_c[i] for i in order]
    b_comm = []
    for k, i in enumerate(order):
        regather = reshard_after_forward and not (root_params and i == 0)
        gather_i = (ag[i] + h2d[i]) if regather else 0.0
        prev_rs = (rs[order[k - 1]] + d2h[order[k - 1]]) if k > 0 else 0.0
        b_comm.append(gather_i + prev_rs)
    bwd = overlapped_pass(b_comp, b_comm, prefetch=prefetch) + rs[order[-1]] + d2h[order[-1]]
    comm_total = (sum(ag) + sum(rs) + sum(ag[i] for i in range(len(units)) if reshard_after_forward)) * micro_batches
    if replicate_size > 1:
        # HSDP: the gradient shards are all-reduced across replicas once per micro-batch, after backward
        rep_bw = collective_bandwidth(hw, replicate_size, spans_nodes=nodes > 1)
        rep = all_reduce_time(-(-total_params // shard) * reduce_bytes, replicate_size, rep_bw, tp)
        bwd += rep
        comm_total += rep * micro_batches
        detail["replicate_all_reduce_s"] = rep
    host_s = (sum(h2d) * (2 if reshard_after_forward else 1) + sum(d2h)) * micro_batches
    cpu_opt = nvme = 0.0
    if offload_cpu or offload_optimizer != "none":
        p_rank = -(-total_params // shard)
        cpu_opt = cpu_optimizer_time(p_rank, per_node, hw, tp, deepspeed_cpu_adam=engine == "deepspeed")
        if engine == "deepspeed" and not offload_cpu:
            # ZeRO-3 with only the optimizer offloaded: grads out during backward, updated params back after
            host_s += host_transfer_time(p_rank * reduce_bytes, hw, tp) + host_transfer_time(
                p_rank * compute_bytes, hw, tp)
            cpu_opt += host_transfer_time(p_rank * compute_bytes, hw, tp)
        if "nvme" in (offload_optimizer, offload_params):
            passes = micro_batches * (2 if reshard_after_forward else 1)
            nvme = nvme_time(*nvme_traffic(p_rank * per_node, optimizer=offload_optimizer == "nvme",
                                           param_bytes=param_bytes if offload_params == "nvme" else 0,
                                           param_reads=passes), hw, tp)
        opt = cpu_opt + nvme
    else:
        opt = optimizer_s / max(1, shard)
    accumulate = 0.0
    if engine == "fsdp2" and offload_cpu and micro_batches > 1:
        # gradients accumulated on the host, serially with backward, from the second micro-batch on
        accumulate = (micro_batches - 1) * -(-total_params // shard) * reduce_bytes / \
            tp.fsdp2_offload_grad_accumulate_bandwidth
    overhead = engine_overhead_time(engine, param_tensors, micro_batches, tp, stage=stage)
    compute = (sum(fwd_c) + sum(bwd_c)) * micro_batches
    exposed = (fwd + bwd) * micro_batches - compute
    passes = pass_time(fwd + bwd, host_issue_s, tm) * micro_batches
    step = passes + opt + overhead + accumulate
    detail.update(_host_detail(fwd + bwd, host_issue_s, micro_batches))
    return ShardedTime(step_s=step, forward_s=fwd * micro_batches, backward_s=bwd * micro_batches, optimizer_s=opt,
                       exposed_comm_s=exposed, comm_s=comm_total, host_transfer_s=host_s,
                       cpu_optimizer_s=cpu_opt, nvme_s=nvme, engine_overhead_s=overhead,
                       host_grad_accumulate_s=accumulate, detail=detail)
