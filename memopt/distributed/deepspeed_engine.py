"""Applying a sharding setting with DeepSpeed: its config dict and ``deepspeed.initialize``.

``deepspeed_config`` turns a ``ShardingSetting`` into DeepSpeed's config (ZeRO stage, bf16/fp16 blocks that keep
16-bit weights with fp32 masters, CPU or NVMe offload, buckets, micro-batch and accumulation); ``build_deepspeed``
checks the offload tiers (``memopt.distributed.host_tier``) and initializes the engine;
``prepare_deepspeed_build_env`` keeps ``TORCH_CUDA_ARCH_LIST`` readable by DeepSpeed's JIT op builder. What memopt
must know of DeepSpeed's own behaviour (swap-buffer sizes, ``max_in_cpu``, reuse distance, the op builder's
parsing) is gathered here, so that the FSDP2 path and the config exports need not know it; DeepSpeed itself is
imported only when an engine is built.
"""

from __future__ import annotations

import os
import re
from collections.abc import MutableMapping, Sequence
from typing import Any

import torch
from torch import nn

from memopt.distributed.engine_buffers import (
    DS_DEFAULT_MAX_LIVE,
    DS_OPTIMIZER_SWAP_BUFFER_COUNT,
    DS_PARAM_SWAP_BUFFER_COUNT,
    DS_PARAM_SWAP_BUFFER_SIZE,
    DS_SUB_GROUP_SIZE,
)
from memopt.distributed.host_tier import machine_host_memory_bytes, validate_offload
from memopt.techniques.sharding import ShardingSetting

__all__ = [
    "build_deepspeed",
    "deepspeed_config",
    "param_swap_buffer_elements",
]

#: memopt's bucket default (bytes): 200 MB of 16-bit elements keeps DeepSpeed's overlap buffers (4.5x) under 1 GB
DEFAULT_BUCKET_BYTES = 200 * 10**6


def deepspeed_config(setting: ShardingSetting, *, precision: str = "bf16_autocast", micro_batch: int = 1,
                     grad_accum: int = 1, optimizer: dict[str, Any] | None = None,
                     gradient_clipping: float | None = None, torch_optimizer: bool = False,
                     aio: dict[str, Any] | None = None, largest_param: int | None = None) -> dict[str, Any]:
    """The DeepSpeed config dict for a setting.

    ``optimizer``: DeepSpeed's ``{"type": "AdamW", "params": {...}}`` block (with CPU offload DeepSpeed
    then uses its CPUAdam); ``torch_optimizer=True`` when a torch optimizer instance is passed to
    ``deepspeed.initialize`` instead (``zero_force_ds_cpu_optimizer: false`` lets it run offloaded).
    ``largest_param``: numel of the model's largest parameter. With parameters on NVMe each swap buffer must hold
    its partition (DeepSpeed 0.19.8 asserts "More elements ... than buffer size" in ``get_buffer``: a 151936 x 896
    embedding is 136M elements, over the 100M default), so ``buffer_size`` grows to it. ``max_in_cpu`` is 0 so that
    the parameters stay on NVMe, as planned (DeepSpeed's default keeps a model under 1e9 parameters in host RAM).
    """
    if setting.engine != "deepspeed":
        raise ValueError(f"deepspeed_config needs engine 'deepspeed', got {setting.engine!r}")
    half = 2 if precision != "fp32" else 4
    bucket = (setting.bucket_bytes or DEFAULT_BUCKET_BYTES) // half
    zero: dict[str, Any] = {"stage": setting.stage, "overlap_comm": setting.overlap_comm,
                            "contiguous_gradients": True, "reduce_bucket_size": int(bucket)}
    if setting.stage in (1, 2):
        zero.update({"allgather_partitions": True, "allgather_bucket_size": int(bucket), "reduce_scatter": True})
    if setting.stage == 3:
        zero.update({"stage3_prefetch_bucket_size": int(bucket) if setting.prefetch else 0,
                     "stage3_param_persistence_threshold": 100_000,
                     "stage3_max_live_parameters": DS_DEFAULT_MAX_LIVE,
                     # parameters swapped in from NVMe hold one swap buffer each until released: kept for reuse,
                     # they exhaust the buffers ("Not enough buffers 0 for swapping 1", DeepSpeed 0.19.8)
                     "stage3_max_reuse_distance": DS_DEFAULT_MAX_LIVE
                     if setting.reshard_after_forward and setting.offload_params != "nvme" else 0,
                     "stage3_gather_16bit_weights_on_model_save": True})
    if setting.offload_optimizer == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": setting.pin_memory}
    elif setting.offload_optimizer == "nvme":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": setting.nvme_path,
                                     "pin_memory": setting.pin_memory,
                                     "buffer_count": DS_OPTIMIZER_SWAP_BUFFER_COUNT, "fast_init": False}
    if setting.offload_params == "cpu":
        zero["offload_param"] = {"device": "cpu", "pin_memory": setting.pin_memory}
    elif setting.offload_params == "nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": setting.nvme_path, "pin_memory": setting.pin_memory,
                                 "buffer_count": DS_PARAM_SWAP_BUFFER_COUNT,
                                 "buffer_size": param_swap_buffer_elements(setting, largest_param),
                                 # DeepSpeed's default (1e9) swaps the first 1e9 elements "permanently to CPU"
                                 # (stage3.py): the parameters would take host RAM the plan gave to NVMe
                                 "max_in_cpu": 0}
    if setting.stage == 3 and setting.offloads:
        zero["sub_group_size"] = DS_SUB_GROUP_SIZE
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": int(micro_batch),
        "gradient_accumulation_steps": int(grad_accum),
        "train_batch_size": int(micro_batch * grad_accum * setting.world_size),
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if precision in ("bf16_autocast", "bf16_master", "bf16_pure"):
        config["bf16"] = {"enabled": True}
    elif precision == "fp16_autocast":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                          "hysteresis": 2, "min_loss_scale": 1}
    if gradient_clipping:
        config["gradient_clipping"] = float(gradient_clipping)
    if optimizer is not None:
        config["optimizer"] = optimizer
    if torch_optimizer and setting.offload_optimizer != "none":
        config["zero_force_ds_cpu_optimizer"] = False
    if "nvme" in (setting.offload_optimizer, setting.offload_params):
        config["aio"] = {"block_size": 1_048_576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                         "overlap_events": True, **(aio or {})}
    return config


def param_swap_buffer_elements(setting: ShardingSetting, largest_param: int | None = None) -> int:
    """Elements of one ZeRO-Infinity parameter swap buffer: DeepSpeed's default (100M), or the largest parameter's
    partition on one rank when that is larger."""
    part = -(-int(largest_param) // setting.world_size) if largest_param else 0
    return max(DS_PARAM_SWAP_BUFFER_SIZE, part)


def _optimizer_block(optimizer_cfg: Any, precision: str) -> dict[str, Any] | None:
    if optimizer_cfg is None:
        return {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}}
    if isinstance(optimizer_cfg, dict):
        return optimizer_cfg
    return None


def plain_arch_list(value: str | None) -> str | None:
    """``TORCH_CUDA_ARCH_LIST`` without architecture-specific suffixes ("9.0a" -> "9.0"; "+PTX" stays).

    DeepSpeed's JIT op builder reads each entry as numbers (``int("0a")`` fails, DeepSpeed 0.19.8), and CUDA
    images for Hopper and Blackwell set "9.0a" / "10.0a". The plain capability builds the same kernels DeepSpeed
    ships (it uses no arch-specific instructions)."""
    if value is None:
        return None
    entries = [e for e in re.split(r"[;\s]+", value.strip()) if e]
    plain = [re.sub(r"^(\d+\.\d+)[a-z]+", r"\1", e) for e in entries]
    return ";".join(dict.fromkeys(plain))


def prepare_deepspeed_build_env(environ: MutableMapping[str, str] | None = None) -> None:
    """Make ``TORCH_CUDA_ARCH_LIST`` (if set) readable by DeepSpeed's op builder, before it JIT-builds an op
    (FusedAdam for ZeRO without offload, CPUAdam with it)."""
    env = os.environ if environ is None else environ
    if env.get("TORCH_CUDA_ARCH_LIST") is not None:
        env["TORCH_CUDA_ARCH_LIST"] = plain_arch_list(env["TORCH_CUDA_ARCH_LIST"]) or ""


def build_deepspeed(model: nn.Module, setting: ShardingSetting, precision: str = "bf16_autocast",
                    optimizer_cfg: Any = None, micro_batch: int = 1, grad_accum: int = 1, *,
                    gradient_clipping: float | None = None, lr_scheduler: Any = None,
                    config_overrides: dict[str, Any] | None = None, checkpoint: Sequence[Any] | None = None,
                    load_device: Any = None) -> tuple[Any, Any]:
    """``deepspeed.initialize`` the model under ``setting``; returns ``(engine, optimizer)``.

    ``checkpoint``: safetensors files to fill a model built on the meta device, one tensor at a time into the
    setting's layout (``memopt.distributed.ds_load``; ``load_device``: this rank's device).

    ``optimizer_cfg``: DeepSpeed's optimizer block (dict; default AdamW lr 1e-4), a torch optimizer
    instance, or a callable taking the parameters. The process group is initialized by DeepSpeed when
    it is not yet (``deepspeed.init_distributed``). An offloading setting is checked first (``validate_offload``
    with this machine's RAM): a missing or read-only NVMe path, too little disk or host RAM raise before DeepSpeed
    starts.
    """
    import deepspeed

    block = _optimizer_block(optimizer_cfg, precision)
    config = deepspeed_config(setting, precision=precision, micro_batch=micro_batch, grad_accum=grad_accum,
                              optimizer=block, gradient_clipping=gradient_clipping, torch_optimizer=block is None,
                              largest_param=max((p.numel() for p in model.parameters()), default=0))
    config.update(config_overrides or {})
    if setting.offloads:  # a missing or read-only NVMe path, too little disk or host RAM: fail before any loading
        validate_offload(setting, machine_host_memory_bytes(),
                         num_params=sum(p.numel() for p in model.parameters() if p.requires_grad), precision=precision)
    if checkpoint is not None:
        # lazy: keeps memopt.distributed.ds_load out of import memopt
        from memopt.distributed.ds_load import load_into_deepspeed_layout

        prepare_deepspeed_build_env()
        load_into_deepspeed_layout(model, checkpoint, config, load_device if load_device is not None else "cpu")
    opt_instance = None
    if block is None:
        opt_instance = optimizer_cfg(list(model.parameters())) if callable(optimizer_cfg) and not isinstance(
            optimizer_cfg, torch.optim.Optimizer) else optimizer_cfg
    kwargs: dict[str, Any] = {"model": model, "config": config}
    if opt_instance is not None:
        kwargs["optimizer"] = opt_instance
    else:
        kwargs["model_parameters"] = [p for p in model.parameters() if p.requires_grad]
    if lr_scheduler is not None:
        kwargs["lr_scheduler"] = lr_scheduler
    prepare_deepspeed_build_env()
    engine, optimizer, _, _ = deepspeed.initialize(**kwargs)
    return engine, optimizer
