"""Per-GPU (and per-node host / NVMe) bytes of the model states under data-parallel sharding: pure arithmetic.

Every function here takes plain numbers (parameter counts, bytes per element, world sizes) and returns
bytes, so the planner can call them while composing an estimate without a model, a process group or
an engine at hand. Activations are not here: they come from memopt's profile as on one GPU (each rank
runs its own micro-batch; sharding does not change them).

Notation (the ZeRO paper's): ``P`` parameters, ``N`` ranks that a state is sharded over.

What each engine keeps, per parameter (``StateBytes``; see ``state_bytes``):

=================== =================================== ==================================================
engine / precision  persistent (sharded per stage)      transient (buffers)
=================== =================================== ==================================================
fsdp2 + mixed       params fp32 4, grads fp32 4,        one unit's params unsharded in bf16 (x2 while the
(MixedPrecision-    Adam fp32 8: 16 B in all, all /N    next unit is prefetched), its unsharded bf16 grads
Policy bf16/fp32)                                       and fp32 reduce-scatter input in backward
fsdp2 + bf16_pure   params 2, grads 2, Adam bf16 4      as above, reduce in bf16
deepspeed mixed     bf16 params 2, bf16 grads 2,        reduce / all-gather buckets (x4.5 with overlap_comm,
(bf16 or fp16)      fp32 master 4 + Adam 8              DeepSpeed's docs), the fp32 grad partition at step
ddp                 everything replicated               DDP's gradient buckets (views with
                                                        gradient_as_bucket_view=True: no extra bytes)
=================== =================================== ==================================================

ZeRO stages over ``N`` ranks: stage 1 shards the master weights and optimizer states, stage 2 the
gradients too, stage 3 the parameters too. FSDP2 is stage 3; hybrid sharding (HSDP, DeepSpeed MiCS)
shards over ``world / replicate_size`` ranks and replicates across the rest.

Offload (DeepSpeed ZeRO-Offload / ZeRO-Infinity, FSDP2 ``CPUOffloadPolicy``) moves the sharded states to
host RAM (pinned) or NVMe; host RAM per node is ``ranks per node x`` one rank's share, plus the pinned
staging buffers of NVMe swapping.

NCCL's own memory (outside PyTorch's allocator): ``NCCL_BYTES_PER_COMMUNICATOR`` per process and
communicator. Source: NVIDIA/nccl#964 (PyTorch on 4 x A100 with NVLink: 544 MB for a 2-rank group,
688 MB for a group of more than 2 ranks, per process); NCCL's maintainer in NVIDIA/nccl#986: the
amount grows with the channels (bandwidth) used and stops growing beyond 2 nodes. Measured on two H200s
with NVLink (torch 2.11, FSDP2, ``benchmarks/sharding/raw/session8_x2``): 1600 MiB outside the allocator per
process, less the 804 MB CUDA runtime of one H200 process: 874 MB. We take that (1 communicator for full
sharding, 2 for hybrid: the shard group and the replicate group).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from memopt.strategy import EIGHT_BIT_OPTIMIZERS

__all__ = [
    "DEEPSPEED_EXTRA_BYTES",
    "DS_DEFAULT_ALLGATHER_BUCKET",
    "DS_DEFAULT_REDUCE_BUCKET",
    "NCCL_BYTES_ONE_RANK",
    "NCCL_BYTES_PER_COMMUNICATOR",
    "ShardedMemory",
    "StateBytes",
    "deepspeed_buffer_bytes",
    "deepspeed_extra_bytes",
    "dtype_bytes",
    "fit_advice",
    "fsdp2_buffer_bytes",
    "fsdp2_offload_traffic",
    "minimum_world_size",
    "model_state_bytes",
    "nccl_bytes",
    "shard_numel",
    "sharded_memory",
    "state_bytes",
    "zero_paper_model_states",
]

#: NCCL memory per process and communicator, outside PyTorch's allocator: measured on 2 x H200 NVLink (874 MB;
#: NVIDIA/nccl#964 reports 544-688 MB on A100 NVLink)
NCCL_BYTES_PER_COMMUNICATOR = 874 * 10**6
#: one process alone in its NCCL group (DeepSpeed and memopt's FSDP2 create one at world size 1 too): 1316 MiB
#: outside the allocator on one H200 (raw/session6_x1, session7 ZeRO-2 offload rows) less the 804 MB runtime
NCCL_BYTES_ONE_RANK = 576 * 10**6
#: what a DeepSpeed engine's process holds outside the allocator beyond an FSDP2 process of the same world size
#: (its own process groups and ops), measured on H200s: 1708 MiB at one rank against FSDP2's 1316 (ZeRO-2 and
#: ZeRO-3, CPU and NVMe offload alike: raw/call1, call3_zero3_rerun, session6_nvme, session8_call5), 2092 MiB at
#: two ranks against 1600 (ZeRO-3, raw/session5_x2_*). ZeRO-2 applied by memopt.wrap held less: 1380-1437 MB
#: in five runs (raw/session8_call2, session9: about the FSDP2 figure). The larger figure is kept for every stage,
#: 0.41 GB on the safe side for ZeRO-1/2, since the validation harness's ZeRO-2 rows held it too
DEEPSPEED_EXTRA_BYTES = {1: 411 * 10**6, 2: 516 * 10**6}
#: DeepSpeed's defaults, in elements (deepspeed/runtime/zero/config.py: reduce_bucket_size, allgather_bucket_size).
DS_DEFAULT_REDUCE_BUCKET = 500_000_000
DS_DEFAULT_ALLGATHER_BUCKET = 500_000_000
#: DeepSpeed ZeRO-3 defaults, in elements (stage3_prefetch_bucket_size, stage3_max_live_parameters).
DS_DEFAULT_PREFETCH_BUCKET = 50_000_000
DS_DEFAULT_MAX_LIVE = 1_000_000_000
#: DeepSpeed's docs on ``overlap_comm``: "uses 4.5x the allgather_bucket_size and reduce_bucket_size values".
DS_OVERLAP_FACTOR = 4.5
#: ZeRO-Infinity swap buffers (deepspeed/runtime/zero/offload_config.py defaults).
DS_PARAM_SWAP_BUFFER_COUNT = 5
DS_PARAM_SWAP_BUFFER_SIZE = 100_000_000  # elements
DS_OPTIMIZER_SWAP_BUFFER_COUNT = 4
DS_SUB_GROUP_SIZE = 1_000_000_000  # elements

_DTYPES = {"fp32": 4, "float32": 4, "tf32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1,
           "int8": 1, "uint8": 1}


def dtype_bytes(dtype: str | int) -> int:
    """Bytes of one element: ``dtype_bytes("bf16") == 2``; an int passes through."""
    if isinstance(dtype, int):
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(_DTYPES)}")
    return _DTYPES[name]


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each model state an engine keeps.

    ``param``: the stored weights (what is sharded at stage 3); ``compute``: the dtype parameters are
    gathered / computed in; ``grad``: the stored gradient; ``master``: an fp32 master copy (0 when the
    stored weights are already the optimizer's); ``optim``: optimizer states; ``reduce``: the dtype
    gradients are reduced in; ``step_grad``: a full-precision copy of the gradient partition made for the
    optimizer step (DeepSpeed ZeRO-1/2 without offload).
    """

    param: int = 4
    compute: int = 4
    grad: int = 4
    master: int = 0
    optim: int = 8
    reduce: int = 4
    step_grad: int = 0

    @property
    def optimizer_side(self) -> int:
        """Master weights + optimizer states: the ZeRO paper's ``K``."""
        return self.master + self.optim


_OPTIM_STATE_FACTOR = {  # bytes of optimizer state per parameter, per byte of the state dtype
    "adamw_fused": 2, "adamw_foreach": 2, "adamw": 2, "adam": 2, "sgd": 1, "user": 2,
}


def state_bytes(engine: str, precision: str = "bf16_autocast", optimizer: str = "adamw_fused") -> StateBytes:
    """What ``engine`` keeps per parameter for a memopt precision and optimizer.

    FSDP2 maps memopt's mixed-precision settings (``bf16_autocast``, ``bf16_master``, ``fp16_autocast``)
    onto ``MixedPrecisionPolicy(param_dtype=bf16/fp16, reduce_dtype=fp32)``: the sharded parameters are
    the fp32 masters, so there is no separate master copy. DeepSpeed's bf16/fp16 modes keep 16-bit
    weights and gradients and an fp32 master partition. ``bf16_pure`` keeps everything in bf16
    (DeepSpeed has no such mode: it is mapped to its bf16 mode). 8-bit optimizers are not sharded by
    either engine here and raise.
    """
    if optimizer in EIGHT_BIT_OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r} (bitsandbytes) is not supported with sharding; use adamw_fused "
                         "(FSDP2 shards torch optimizers) or DeepSpeed's own Adam")
    factor = _OPTIM_STATE_FACTOR.get(optimizer, 2)
    half = 2
    if engine in ("fsdp2", "ddp"):
        if precision == "fp32":
            return StateBytes(param=4, compute=4, grad=4, master=0, optim=4 * factor, reduce=4)
        if precision == "bf16_pure":
            return StateBytes(param=2, compute=2, grad=2, master=0, optim=2 * factor, reduce=2)
        if engine == "ddp":
            if precision == "bf16_master":
                return StateBytes(param=2, compute=2, grad=2, master=4, optim=4 * factor, reduce=2)
            return StateBytes(param=4, compute=4, grad=4, master=0, optim=4 * factor, reduce=4)
        return StateBytes(param=4, compute=half, grad=4, master=0, optim=4 * factor, reduce=4)
    if engine == "deepspeed":
        if precision == "fp32":
            return StateBytes(param=4, compute=4, grad=4, master=0, optim=4 * factor, reduce=4, step_grad=0)
        return StateBytes(param=2, compute=2, grad=2, master=4, optim=4 * factor, reduce=2, step_grad=4)
    raise ValueError(f"unknown engine {engine!r}; one of 'ddp', 'fsdp2', 'deepspeed'")


def shard_numel(numel: int, shape0: int | None, n: int) -> int:
    """Elements one rank stores of a tensor of ``numel`` elements sharded over ``n`` ranks.

    FSDP2 shards dim 0 and pads every rank's shard to ``ceil(dim0 / n)`` rows; pass the tensor's dim-0
    size as ``shape0`` for that. Without ``shape0`` the flat ``ceil(numel / n)`` is returned (DeepSpeed
    pads its flat partitions the same way up to alignment).
    """
    if n <= 1:
        return numel
    if shape0 is None or shape0 <= 0:
        return -(-numel // n)
    rows = -(-shape0 // n)
    return rows * (numel // shape0)


# -- model states -------------------------------------------------------------------------------------
def model_state_bytes(num_params: int, *, stage: int, shard_size: int, sb: StateBytes) -> dict[str, int]:
    """Persistent per-GPU bytes of params, gradients and optimizer side (master + states) at a ZeRO stage.

    Stage 0 replicates everything; stage 1 shards master + optimizer states over ``shard_size`` ranks;
    stage 2 also the gradients; stage 3 also the parameters. Flat ``ceil`` sharding (no per-tensor padding).
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    n = max(1, shard_size)
    shard = -(-num_params // n)
    params = num_params * sb.param if stage < 3 else shard * sb.param
    grads = num_params * sb.grad if stage < 2 else shard * sb.grad
    optim = (num_params if stage == 0 else shard) * sb.optimizer_side
    return {"params": params, "grads": grads, "optimizer": optim}


def zero_paper_model_states(num_params: float, world_size: int, k: int = 12) -> dict[str, float]:
    """The ZeRO paper's Figure 1 figures (mixed-precision Adam: 2 + 2 + K bytes per parameter).

    Returns bytes per GPU for "baseline", "pos", "pos+g" and "pos+g+p" (Rajbhandari et al., 2020, sec. 5:
    7.5B parameters on 64 GPUs give 120, 31.4, 16.6 and 1.9 GB).
    """
    n, psi = world_size, float(num_params)
    return {"baseline": (2 + 2 + k) * psi, "pos": 2 * psi + 2 * psi + k * psi / n,
            "pos+g": 2 * psi + (2 + k) * psi / n, "pos+g+p": (2 + 2 + k) * psi / n}


# -- buffers --------------------------------------------------------------------------------------------
def fsdp2_buffer_bytes(unit_params: Sequence[int], *, shard_size: int, sb: StateBytes, prefetch: int = 1,
                       root_params: int = 0, reshard_after_forward: bool = True,
                       forward_overlap: bool = False, stream_overlap: bool = False) -> dict[str, int]:
    """Bytes of FSDP2's unsharded parameters, unsharded gradients and collective buffers on one GPU.

    ``unit_params``: parameters of each ``fully_shard`` unit (the blocks), in forward order;
    ``root_params``: the root module's own parameters (embeddings, head, final norm). The root is not
    resharded after forward: its gathered parameters stay from its forward to the end of backward, and its
    unsharded gradients (in the compute dtype) from the head's backward to the end.

    Backward, at the unit being processed: its gathered parameters, the flat all-gather output of the
    ``prefetch`` units FSDP2 gathers ahead (none for the last unit), its unsharded gradients (compute
    dtype) and the reduce-scatter input they are copied into (reduce dtype); the reduce-scatter output
    is the sharded gradient (counted with the gradients). Forward: the unit's gathered parameters and,
    during copy-out, the flat all-gather output of the same size; with ``forward_overlap`` (a GPU, where
    the next all-gather runs on its own stream while the unit computes) also ``prefetch`` more units.
    ``stream_overlap`` adds the previous unit's reduce-scatter input still in flight on a GPU.
    This is what PyTorch's ``FSDPMemTracker`` measures on one stream (see ``memopt.distributed.simulate``).
    With ``reshard_after_forward=False`` every unit stays gathered from its forward to its backward.

    Returns the peaks (``forward_peak``, ``backward_peak``, ``peak``) and ``backward_by_unit``: the
    buffer bytes while unit ``k`` of the backward order is processed (``sharded_memory`` adds the
    gradient shards reduced so far to find the joint peak with the model states).
    """
    if not unit_params:
        unit_params = [0]
    units = list(unit_params)
    c, r = sb.compute, sb.reduce
    ahead = max(0, prefetch)
    root = root_params * c
    root_grads = root_params * c
    back = units[::-1]
    held_all = sum(units) * c if not reshard_after_forward else 0
    by_unit = []
    for k, u in enumerate(back):
        nxt = back[k + 1:k + 1 + ahead]
        current = u * c if reshard_after_forward else 0
        gathering = sum(nxt) * c if reshard_after_forward else 0
        inflight = back[k - 1] * r if (stream_overlap and k > 0) else 0
        # units already processed have been resharded and their gradients reduced
        still_held = (sum(back[k:]) * c) if not reshard_after_forward else 0
        by_unit.append(root + root_grads + current + gathering + still_held + u * c + u * r + inflight)
    big = max(units)
    fwd_units = (1 + (ahead if forward_overlap else 0)) * big * c if reshard_after_forward else held_all
    fwd = root + fwd_units + big * c
    bwd = max(by_unit)
    return {"unsharded_params": root + (max(fwd_units, (1 + ahead) * big * c) if reshard_after_forward
                                        else held_all),
            "all_gather": big * c, "unsharded_grads": big * c + root_grads, "reduce_scatter": big * r,
            "peak": max(fwd, bwd), "forward_peak": fwd, "backward_peak": bwd, "backward_by_unit": by_unit}


def deepspeed_buffer_bytes(num_params: int, *, stage: int, shard_size: int, sb: StateBytes,
                           largest_module_params: int = 0, reduce_bucket: int = DS_DEFAULT_REDUCE_BUCKET,
                           allgather_bucket: int = DS_DEFAULT_ALLGATHER_BUCKET, overlap_comm: bool = True,
                           prefetch_bucket: int = DS_DEFAULT_PREFETCH_BUCKET,
                           max_live_parameters: int = DS_DEFAULT_MAX_LIVE,
                           offload_optimizer: bool = False) -> dict[str, int]:
    """Peak bytes of DeepSpeed's communication buffers on one GPU (bucket sizes in elements).

    ZeRO-1/2: the reduce and all-gather buckets in the 16-bit dtype, times 4.5 with ``overlap_comm``
    (DeepSpeed's configuration docs: "overlap_comm ... uses 4.5x the allgather_bucket_size and
    reduce_bucket_size values"), and at the optimizer step an fp32 copy of the gradient partition
    (``StateBytes.step_grad``; none when the optimizer is offloaded). Buckets never exceed the model.
    ZeRO-3: the gathered parameters — at least the largest module (DeepSpeed gathers module by module),
    at most ``stage3_max_live_parameters`` plus the prefetch bucket — and the reduce bucket (doubled
    with ``overlap_comm``).
    """
    n = max(1, shard_size)
    c = sb.compute
    rb = min(reduce_bucket, num_params)
    if stage in (0, 1, 2):
        ab = min(allgather_bucket, num_params)
        buckets = (rb + ab) * c
        if overlap_comm:
            buckets = int(DS_OVERLAP_FACTOR * buckets)
        step = 0 if offload_optimizer else -(-num_params // n) * sb.step_grad
        return {"buckets": buckets, "step_grad": step, "gathered_params": 0, "peak": buckets + step}
    live = min(max_live_parameters + prefetch_bucket, num_params)
    live = max(live, largest_module_params)
    gathered = live * c
    reduce = rb * c * (2 if overlap_comm else 1)
    # the step converts one optimizer sub-group's gradients to fp32 at a time (sub_group_size elements)
    step = 0 if offload_optimizer else min(DS_SUB_GROUP_SIZE, -(-num_params // n)) * sb.step_grad
    return {"buckets": reduce, "step_grad": step, "gathered_params": gathered, "peak": max(gathered + reduce, step)}


def deepspeed_extra_bytes(engine: str, world_size: int) -> int:
    """``DEEPSPEED_EXTRA_BYTES`` for a DeepSpeed engine (the two-rank figure beyond two ranks), else 0."""
    if engine != "deepspeed":
        return 0
    return DEEPSPEED_EXTRA_BYTES[1] if world_size <= 1 else DEEPSPEED_EXTRA_BYTES[2]


def nccl_bytes(world_size: int, replicate_size: int = 1, *, per_communicator: int = NCCL_BYTES_PER_COMMUNICATOR
               ) -> int:
    """NCCL's memory per process outside PyTorch's allocator: one communicator per process group used."""
    if world_size <= 1:
        return NCCL_BYTES_ONE_RANK
    groups = 1 if replicate_size <= 1 or replicate_size >= world_size else 2
    return groups * per_communicator


# -- the whole picture -------------------------------------------------------------------------------
@dataclass
class ShardedMemory:
    """Per-GPU device bytes, per-node host bytes and per-node NVMe bytes of one sharding setting."""

    params: int
    grads: int
    optimizer: int
    buffers: int
    nccl: int  # outside PyTorch's allocator (NCCL; DeepSpeed's own groups and ops)
    host_bytes: int  # host RAM per node for the offloaded states and staging buffers
    host_pinned_bytes: int  # of host_bytes, page-locked
    nvme_bytes: int  # per node
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def device_bytes(self) -> int:
        """Persistent model states plus the buffers' peak (an upper bound of their joint peak)."""
        return self.model_states + self.buffers

    @property
    def peak_bytes(self) -> int:
        """The joint peak of model states and buffers (without activations and NCCL)."""
        grads = self.detail.get("grads_at_peak", self.grads)
        return self.params + grads + self.optimizer + self.buffers

    def to_dict(self) -> dict[str, Any]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer, "buffers": self.buffers,
                "nccl": self.nccl, "model_states": self.model_states, "device_bytes": self.device_bytes,
                "peak_bytes": self.peak_bytes,
                "host_bytes": self.host_bytes, "host_pinned_bytes": self.host_pinned_bytes,
                "nvme_bytes": self.nvme_bytes, **self.detail}


def sharded_memory(num_params: int, *, engine: str, stage: int, world_size: int, sb: StateBytes,
                   unit_params: Sequence[int] = (), root_params: int = 0, largest_module_params: int = 0,
                   nodes: int = 1, replicate_size: int = 1, offload_optimizer: str = "none",
                   offload_params: str = "none", prefetch: int = 1, reshard_after_forward: bool = True,
                   bucket_elements: int | None = None, overlap_comm: bool = True,
                   forward_overlap: bool = False, stream_overlap: bool = False,
                   micro_batches: int = 1) -> ShardedMemory:
    """Per-GPU model states, buffers and NCCL memory, host RAM and NVMe per node, of one setting.

    ``num_params``: trainable parameters (frozen ones count as ``params`` only: pass them in
    ``unit_params``/``root_params`` for the buffers, and add their stored bytes yourself). ``unit_params``
    and ``root_params`` matter for FSDP2 (see ``fsdp2_buffer_bytes``); ``largest_module_params`` for
    DeepSpeed ZeRO-3. ``bucket_elements`` overrides DeepSpeed's bucket sizes.

    FSDP2: ``buffers`` is the buffer bytes at the joint peak of model states and buffers, and
    ``detail["grads_at_peak"]`` the gradient bytes present then (with one micro-batch the peak falls in
    backward before every gradient shard exists); ``peak_bytes`` is their sum with params and optimizer.
    """
    if world_size < 1 or nodes < 1 or world_size % nodes:
        raise ValueError(f"world_size {world_size} must be a positive multiple of nodes {nodes}")
    if replicate_size < 1 or world_size % replicate_size:
        raise ValueError(f"replicate_size {replicate_size} must divide world_size {world_size}")
    if engine == "ddp":
        stage = 0
    shard = world_size // replicate_size
    per_node = world_size // nodes
    states = model_state_bytes(num_params, stage=stage, shard_size=shard, sb=sb)
    params, grads, optim = states["params"], states["grads"], states["optimizer"]
    detail: dict[str, Any] = {"engine": engine, "stage": stage, "shard_size": shard, "ranks_per_node": per_node}
    host = pinned = nvme = 0
    p_shard = -(-num_params // shard)
    if engine == "fsdp2":
        if offload_params != "none" or offload_optimizer != "none":
            # CPUOffloadPolicy: sharded params and grads live on the host (pinned), the optimizer steps there
            host_rank = p_shard * (sb.param + sb.grad + sb.optimizer_side)
            host = host_rank * per_node
            pinned = p_shard * (sb.param + sb.grad) * per_node
            params = grads = optim = 0
            detail["offload"] = "cpu"
        units = list(unit_params or [num_params])
        buf = fsdp2_buffer_bytes(units, shard_size=shard, sb=sb, prefetch=prefetch, root_params=root_params,
                                 reshard_after_forward=reshard_after_forward, forward_overlap=forward_overlap,
                                 stream_overlap=stream_overlap)
        detail["buffers"] = buf
        # the joint peak of states and buffers: in the last micro-batch's backward, unit k of the backward
        # order holds its buffers while the gradient shards of the units before it (and, with accumulation,
        # all gradients of the earlier micro-batches) exist; the forward holds every gradient when m > 1
        grad_unit = sb.grad if grads else 0
        back = units[::-1]
        done, best, best_grads = 0, 0, 0
        for k, b in enumerate(buf["backward_by_unit"]):
            g = grads if micro_batches > 1 else done * grad_unit
            if b + g > best:
                best, best_grads = b + g, g
            done += -(-back[k] // shard)
        fwd_g = grads if micro_batches > 1 else 0
        if buf["forward_peak"] + fwd_g > best:
            best, best_grads = buf["forward_peak"] + fwd_g, fwd_g
        buffers = best - best_grads
        detail["grads_at_peak"] = best_grads
    elif engine == "deepspeed":
        kw: dict[str, Any] = {}
        if bucket_elements:
            kw = {"reduce_bucket": bucket_elements, "allgather_bucket": bucket_elements}
        buf = deepspeed_buffer_bytes(num_params, stage=stage, shard_size=shard, sb=sb,
                                     largest_module_params=largest_module_params, overlap_comm=overlap_comm,
                                     offload_optimizer=offload_optimizer != "none", **kw)
        buffers = buf["peak"]
        detail["buffers"] = buf
        if offload_optimizer != "none":
            # ZeRO-Offload: fp32 master + optimizer states + fp32 gradient partition on the host
            opt_rank = p_shard * sb.optimizer_side
            grad_rank = p_shard * 4
            optim = 0
            if stage >= 2:
                grads = 0  # gradients are reduced straight into the host fp32 buffer
            if offload_optimizer == "cpu":
                host += (opt_rank + grad_rank) * per_node
                pinned += (opt_rank + grad_rank) * per_node
            else:  # nvme: states swapped; fp32 grads and the swap buffers stay in pinned host memory, and the
                # fp32 gradients are also written to NVMe at each accumulation boundary (counted on the CPU machine:
                # tests/distributed/test_nvme_offload.py)
                nvme += (opt_rank + grad_rank) * per_node
                swap = DS_OPTIMIZER_SWAP_BUFFER_COUNT * min(DS_SUB_GROUP_SIZE, p_shard) * 4
                host += (grad_rank + swap) * per_node
                pinned += (grad_rank + swap) * per_node
                detail["optimizer_swap_buffer_bytes"] = swap
        if offload_params != "none":
            if stage != 3:
                raise ValueError("DeepSpeed offloads parameters only at ZeRO stage 3 (offload_param)")
            params = 0
            if offload_params == "cpu":
                host += p_shard * sb.param * per_node
                pinned += p_shard * sb.param * per_node
            else:
                nvme += p_shard * sb.param * per_node
                swap = DS_PARAM_SWAP_BUFFER_COUNT * DS_PARAM_SWAP_BUFFER_SIZE * sb.param
                host += swap * per_node
                pinned += swap * per_node
                detail["param_swap_buffer_bytes"] = swap
    else:  # ddp: buckets are views of the gradients (gradient_as_bucket_view=True)
        buffers = 0
        detail["buffers"] = {"peak": 0}
        if offload_optimizer != "none" or offload_params != "none":
            raise ValueError("DDP does not offload; use engine 'fsdp2' or 'deepspeed'")
    return ShardedMemory(params=params, grads=grads, optimizer=optim, buffers=buffers,
                         nccl=nccl_bytes(world_size, replicate_size) + deepspeed_extra_bytes(engine, world_size),
                         host_bytes=host, host_pinned_bytes=pinned,
                         nvme_bytes=nvme, detail=detail)


def fsdp2_offload_traffic(unit_params: Sequence[int], *, shard_size: int, sb: StateBytes, root_params: int = 0,
                          reshard_after_forward: bool = True, micro_batches: int = 1,
                          shape0: Sequence[Sequence[tuple[int, int]]] | None = None) -> dict[str, int]:
    """Bytes FSDP2 with ``CPUOffloadPolicy`` moves per optimizer step, per rank.

    Host-to-device: each unit's padded sharded parameters in their stored dtype (the cast to the compute
    dtype happens on the GPU) every time the unit is gathered — in forward, and again in backward when
    it was resharded after forward (the root never is). Device-to-host: each unit's reduced gradient
    shard in the reduce dtype, once per micro-batch. ``shape0`` optionally gives per unit the
    ``(numel, dim0)`` of each parameter for FSDP2's exact row padding.
    """
    n = max(1, shard_size)
    units = list(unit_params) + ([root_params] if root_params else [])

    def shard_of(i: int) -> int:
        if shape0 is not None and i < len(shape0):
            return sum(shard_numel(numel, d0, n) for numel, d0 in shape0[i])
        return -(-units[i] // n)

    h2d = d2h = 0
    for i in range(len(units)):
        is_root = root_params and i == len(units) - 1
        gathers = 1 if (is_root or not reshard_after_forward) else 2
        h2d += shard_of(i) * sb.param * gathers
        d2h += shard_of(i) * sb.reduce
    return {"h2d_bytes": h2d * micro_batches, "d2h_bytes": d2h * micro_batches}


# -- what would fit ------------------------------------------------------------------------------------
def minimum_world_size(per_gpu_bytes_fn: Any, budget_bytes: int, *, max_world: int = 4096) -> int | None:
    """Smallest world size (power-of-two steps, then exact) whose ``per_gpu_bytes_fn(world)`` fits the budget."""
    lo_fit = None
    w = 1
    while w <= max_world:
        if per_gpu_bytes_fn(w) <= budget_bytes:
            lo_fit = w
            break
        w *= 2
    if lo_fit is None:
        return None
    lo = max(1, lo_fit // 2 + 1)
    for cand in range(lo, lo_fit + 1):
        if per_gpu_bytes_fn(cand) <= budget_bytes:
            return cand
    return lo_fit


def fit_advice(num_params: int, *, budget_bytes: int, world_size: int, gpus_per_node: int = 8,
               sb: StateBytes | None = None, other_bytes: int = 0, unit_params: int = 0,
               host_ram_bytes: int = 0) -> str:
    """What would make ``num_params`` fit ``budget_bytes`` per GPU when the current world size cannot.

    ``other_bytes``: what each GPU needs besides model states and buffers (activations, runtime, NCCL).
    Returns one sentence per option: the GPUs each ZeRO stage needs, CPU offload (and the host RAM it
    takes per node), NVMe offload.
    """
    sb = sb or state_bytes("fsdp2", "bf16_autocast")
    unit = unit_params or max(1, num_params // 32)
    room = budget_bytes - other_bytes
    lines = []
    if room <= 0:
        return (f"activations and runtime alone take {other_bytes / 1e9:.1f} GB of the {budget_bytes / 1e9:.1f} GB "
                "budget: checkpoint more activations, use a smaller micro-batch or a larger budget")
    for stage in (1, 2, 3):
        def need(w: int, stage: int = stage) -> int:
            s = model_state_bytes(num_params, stage=stage, shard_size=w, sb=sb)
            extra = fsdp2_buffer_bytes([unit], shard_size=w, sb=sb)["peak"] if stage == 3 else 0
            return sum(s.values()) + extra

        w = minimum_world_size(need, room)
        lines.append(f"ZeRO-{stage}: " + (f"at least {w} GPUs" if w else "does not fit at any world size"))
    offload_gpu = fsdp2_buffer_bytes([unit], shard_size=world_size, sb=sb)["peak"]
    host_node = -(-num_params // world_size) * (sb.param + sb.grad + sb.optimizer_side) * min(world_size,
                                                                                             gpus_per_node)
    if offload_gpu <= room:
        ram = f"{host_node / 1e9:.0f} GB of host RAM per node"
        if host_ram_bytes and host_node > host_ram_bytes:
            ram += f" (more than the {host_ram_bytes / 1e9:.0f} GB there: add nodes or use NVMe offload)"
        lines.append(f"CPU offload of parameters and optimizer (FSDP2 CPUOffloadPolicy / ZeRO-3 offload) on "
                     f"{world_size} GPUs: {offload_gpu / 1e9:.1f} GB per GPU for gathered blocks, {ram}")
        lines.append("NVMe offload (DeepSpeed ZeRO-Infinity: offload_param/offload_optimizer device nvme with an "
                     "nvme_path on a local SSD) when host RAM is short")
    else:
        lines.append(f"even with full offload one gathered block needs {offload_gpu / 1e9:.1f} GB: more GPUs or "
                     "smaller blocks")
    return "; ".join(lines)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


_ = math
