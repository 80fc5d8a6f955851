"""``memopt.distributed``: training beyond one GPU's memory — sharding (FSDP2, DeepSpeed ZeRO) and offload.

* ``sharding``: ``ShardingSetting``, ``apply_fsdp2``, ``build_deepspeed``, config exports, ``validate_offload``;
* ``train_step``: ``DistributedTrainStep`` (the same ``step(batch)`` under FSDP2, DDP or a DeepSpeed engine);
* ``memory`` / ``timing``: pure estimator pieces (bytes and seconds from plain numbers) for the planner;
* ``checkpoint``: resharding checkpoints (DCP) and ``load_sharded`` (pretrained weights shard by shard).

Importing this package imports neither DeepSpeed nor the distributed runtime: they load on use.
"""

from memopt.distributed.memory import ShardedMemory, StateBytes, sharded_memory, state_bytes
from memopt.distributed.sharding import (
    ShardingSetting,
    apply_ddp,
    apply_fsdp2,
    build_deepspeed,
    deepspeed_config,
    export_accelerate_config,
    export_deepspeed_json,
    mp_policy_for,
    validate_offload,
)
from memopt.distributed.timing import ShardedTime, TimingParams, sharded_step_time

__all__ = [
    "ShardedMemory",
    "ShardedTime",
    "ShardingSetting",
    "StateBytes",
    "TimingParams",
    "apply_ddp",
    "apply_fsdp2",
    "build_deepspeed",
    "deepspeed_config",
    "export_accelerate_config",
    "export_deepspeed_json",
    "mp_policy_for",
    "sharded_memory",
    "sharded_step_time",
    "state_bytes",
    "validate_offload",
]
