"""``memopt.distributed``: training beyond one GPU's memory — sharding (FSDP2, DeepSpeed ZeRO) and offload.

* ``sharding``: ``ShardingSetting`` (how the states are spread and offloaded, as a ``Strategy`` carries it);
* ``torch_engines`` / ``deepspeed_engine``: applying it (``apply_fsdp2``, ``apply_ddp``; ``build_deepspeed``,
  ``deepspeed_config``);
* ``config_export``: the same decisions as files for other launchers (DeepSpeed JSON, accelerate YAML);
* ``host_tier``: this machine's host RAM and NVMe checked against an offload setting (``validate_offload``);
* ``train_step``: ``DistributedTrainStep`` (the same ``step(batch)`` under FSDP2, DDP or a DeepSpeed engine);
* ``model_states`` / ``engine_buffers`` / ``memory`` / ``timing``: pure estimator pieces (bytes and seconds from
  plain numbers) for the planner;
* ``timeline`` / ``engine_bytes`` / ``estimate``: the sharded estimate of a profiled step (activations joined
  with the engine's bytes along the step, reserved per allocator pool, and the step time);
* ``checkpoint``: resharding checkpoints (DCP) and ``load_sharded`` (pretrained weights shard by shard).

Importing this package imports neither DeepSpeed nor the distributed runtime: they load on use.
"""

from memopt.distributed.config_export import export_accelerate_config, export_deepspeed_json
from memopt.distributed.deepspeed_engine import build_deepspeed, deepspeed_config
from memopt.distributed.host_tier import validate_offload
from memopt.distributed.memory import ShardedMemory, sharded_memory
from memopt.distributed.model_states import StateBytes, state_bytes
from memopt.distributed.timing import ShardedTime, TimingParams, sharded_step_time
from memopt.distributed.torch_engines import apply_ddp, apply_fsdp2, mp_policy_for
from memopt.techniques.sharding import ShardingSetting

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
