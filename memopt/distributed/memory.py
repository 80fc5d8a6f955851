"""Per-GPU (and per-node host / NVMe) bytes of one sharding setting's model states and buffers: pure arithmetic.

Every function here takes plain numbers (parameter counts, bytes per element, world sizes) and returns
bytes, so the planner can call them while composing an estimate without a model, a process group or
an engine at hand. ``sharded_memory`` joins the model states (``memopt.distributed.model_states``) and the
engines' buffers (``memopt.distributed.engine_buffers``) into one setting's picture; ``fit_advice`` says what
would fit when nothing does. Activations are not here: they come from memopt's profile as on one GPU (each rank
runs its own micro-batch; sharding does not change them).

Offload (DeepSpeed ZeRO-Offload / ZeRO-Infinity, FSDP2 ``CPUOffloadPolicy``) moves the sharded states to
host RAM (pinned) or NVMe; host RAM per node is ``ranks per node x`` one rank's share, plus the pinned
staging buffers of NVMe swapping.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from memopt.distributed.engine_buffers import (
    DS_OPTIMIZER_SWAP_BUFFER_COUNT,
    DS_PARAM_SWAP_BUFFER_COUNT,
    DS_PARAM_SWAP_BUFFER_SIZE,
    DS_SUB_GROUP_SIZE,
    deepspeed_buffer_bytes,
    deepspeed_extra_bytes,
    fsdp2_buffer_bytes,
    nccl_bytes,
)
from memopt.distributed.model_states import StateBytes, model_state_bytes, shard_numel, state_bytes

__all__ = [
    "ShardedMemory",
    "fit_advice",
    "fsdp2_offload_traffic",
    "minimum_world_size",
    "sharded_memory",
]


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


def pinned_block_bytes(nbytes: int) -> int:
    """What one ``tensor.pin_memory()`` of ``nbytes`` takes: torch's caching host allocator rounds every
    page-locked block up to a power of two (an 11.2 GB fp32 partition pins 17.2 GB)."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def zero2_cpu_offload_host_bytes(p_shard: int, sb: StateBytes, largest_param: int = 0) -> tuple[int, int]:
    """(host, pinned) bytes of one rank's ZeRO-1/2 CPU optimizer offload, as DeepSpeed's stage_1_and_2 builds them:
    pinned flat tensors for the fp32 master partition, its fp32 gradient and a 16-bit staging copy of the
    partition, plus a 16-bit gradient staging buffer of the largest parameter, each a power of two
    (``pinned_block_bytes``); the optimizer's moments pageable. Gradient accumulation's pinned 16-bit buffer per
    parameter depends on the run, not the setting: ``memopt.distributed.estimate`` adds it."""
    master, grad, staging = p_shard * 4, p_shard * 4, p_shard * 2
    pinned = (pinned_block_bytes(master) + pinned_block_bytes(grad) + pinned_block_bytes(staging)
              + pinned_block_bytes(largest_param * 2))
    moments = p_shard * sb.optimizer_side - master
    return pinned + moments, pinned


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
            if offload_optimizer == "cpu" and stage <= 2:
                rank_host, rank_pinned = zero2_cpu_offload_host_bytes(p_shard, sb, largest_module_params)
                host += rank_host * per_node
                pinned += rank_pinned * per_node
            elif offload_optimizer == "cpu":
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
