"""The engines' transient bytes on one GPU, and the memory NCCL and DeepSpeed hold outside PyTorch's allocator.

FSDP2's gathered units, unsharded gradients and collective buffers (``fsdp2_buffer_bytes``), DeepSpeed's buckets
and gathered parameters (``deepspeed_buffer_bytes``), and the bytes outside the allocator (``nccl_bytes``,
``deepspeed_extra_bytes``), with the DeepSpeed defaults these depend on. They are kept apart from the persistent
model states (``memopt.distributed.model_states``) because they depend on how each engine schedules its
collectives (units, buckets, prefetch) rather than on the ZeRO stage alone, and the DeepSpeed defaults they rest on
are also what ``memopt.distributed.deepspeed_engine`` configures DeepSpeed with.

NCCL's own memory (outside PyTorch's allocator): ``NCCL_BYTES_PER_COMMUNICATOR`` per process and
communicator. Source: NVIDIA/nccl#964 (PyTorch on 4 x A100 with NVLink: 544 MB for a 2-rank group,
688 MB for a group of more than 2 ranks, per process); NCCL's maintainer in NVIDIA/nccl#986: the
amount grows with the channels (bandwidth) used and stops growing beyond 2 nodes. Measured on two H200s
with NVLink (torch 2.11, FSDP2, ``benchmarks/sharding/raw/session8_x2``): 1600 MiB outside the allocator per
process, less the 804 MB CUDA runtime of one H200 process: 874 MB. We take that (1 communicator for full
sharding, 2 for hybrid: the shard group and the replicate group).
"""

from __future__ import annotations

from collections.abc import Sequence

from memopt.distributed.model_states import StateBytes

__all__ = [
    "DEEPSPEED_EXTRA_BYTES",
    "DS_DEFAULT_ALLGATHER_BUCKET",
    "DS_DEFAULT_REDUCE_BUCKET",
    "NCCL_BYTES_ONE_RANK",
    "NCCL_BYTES_PER_COMMUNICATOR",
    "deepspeed_buffer_bytes",
    "deepspeed_extra_bytes",
    "fsdp2_buffer_bytes",
    "nccl_bytes",
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
