"""A plan's sharding decisions as files, for users with their own launcher: DeepSpeed's JSON, accelerate's YAML.

``export_deepspeed_json`` writes the config that ``memopt.distributed.deepspeed_engine.deepspeed_config`` makes;
``export_accelerate_config`` writes accelerate's config YAML (``accelerate launch --config_file``) for FSDP2 or
DeepSpeed. They are kept apart from the engines because they need neither a process group nor an engine: only the
setting and the strategy's precision, micro-batch, accumulation and checkpointing are read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from memopt.distributed.deepspeed_engine import deepspeed_config
from memopt.techniques.sharding import sharding_of

__all__ = [
    "export_accelerate_config",
    "export_deepspeed_json",
]


def export_deepspeed_json(plan_or_strategy: Any, path: str | os.PathLike[str], **overrides: Any) -> dict[str, Any]:
    """Write the DeepSpeed config JSON of a plan's (or strategy's) sharding setting; returns the dict."""
    strategy, setting = sharding_of(plan_or_strategy)
    config = deepspeed_config(setting, precision=strategy.precision, micro_batch=strategy.micro_batch_size,
                              grad_accum=strategy.grad_accum_steps,
                              optimizer=overrides.pop("optimizer", {"type": "AdamW",
                                                                    "params": {"lr": 1e-4, "weight_decay": 0.0}}),
                              **overrides)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(config, indent=2) + "\n")
    return config


def _mixed_precision_name(precision: str) -> str:
    return {"bf16_autocast": "bf16", "bf16_master": "bf16", "bf16_pure": "bf16", "fp16_autocast": "fp16"}.get(
        precision, "no")


def export_accelerate_config(plan_or_strategy: Any, path: str | os.PathLike[str], *,
                             block_class: str | None = None, deepspeed_json: str | os.PathLike[str] | None = None
                             ) -> dict[str, Any]:
    """Write accelerate's config YAML (``accelerate launch --config_file``) for FSDP2 or DeepSpeed.

    FSDP2: ``fsdp_version: 2`` with transformer-based wrapping of ``block_class`` (the repeated block,
    e.g. ``LlamaDecoderLayer``), ``fsdp_reshard_after_forward``, ``fsdp_offload_params``, sharded state
    dicts, RAM-efficient loading and activation checkpointing as the strategy says. DeepSpeed: the
    config JSON is written next to the YAML (or to ``deepspeed_json``) and referenced by
    ``deepspeed_config_file``. ``num_processes``/``num_machines`` come from the setting.
    """
    import yaml

    strategy, setting = sharding_of(plan_or_strategy)
    if block_class is None:
        model_info = getattr(plan_or_strategy, "model", None) or {}
        block_class = model_info.get("block_class") if isinstance(model_info, dict) else None
    data: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "machine_rank": 0,
        "main_training_function": "main",
        "num_machines": setting.nodes,
        "num_processes": setting.world_size,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    }
    if setting.engine == "fsdp2":
        if setting.replicate_size > 1:
            raise ValueError("accelerate's FSDP config has no hybrid sharding for FSDP2; export engine 'fsdp2' with "
                             "replicate_size=1 or use the Python API (apply_fsdp2)")
        fsdp: dict[str, Any] = {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_reshard_after_forward": setting.reshard_after_forward,
            "fsdp_offload_params": setting.offload_params == "cpu",
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_activation_checkpointing": strategy.checkpointing.mode == "full",
        }
        if block_class:
            fsdp["fsdp_transformer_layer_cls_to_wrap"] = block_class
        data.update({"distributed_type": "FSDP", "mixed_precision": _mixed_precision_name(strategy.precision),
                     "fsdp_config": fsdp})
    elif setting.engine == "deepspeed":
        json_path = Path(deepspeed_json) if deepspeed_json else Path(path).with_suffix(".deepspeed.json")
        export_deepspeed_json(strategy, json_path)
        data.update({"distributed_type": "DEEPSPEED",
                     "deepspeed_config": {"deepspeed_config_file": str(json_path),
                                          "zero3_init_flag": setting.stage == 3}})
    else:
        data.update({"distributed_type": "MULTI_GPU" if setting.world_size > 1 else "NO",
                     "mixed_precision": _mixed_precision_name(strategy.precision)})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))
    return data
