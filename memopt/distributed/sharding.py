"""Sharding and offload across GPUs: the setting, applying it (FSDP2, DeepSpeed), config exports, checks.

A ``ShardingSetting`` rides in a ``Strategy`` as ``strategy.extra("sharding")`` (a ``ShardingSetting`` or
its dict). It is applied by

* ``apply_fsdp2``: ``torch.distributed.fsdp.fully_shard`` on every block and on the root, with a
  ``MixedPrecisionPolicy`` and, when offloading, a ``CPUOffloadPolicy``; hybrid sharding (HSDP) over a
  2-D mesh when ``replicate_size > 1``;
* ``build_deepspeed``: ``deepspeed.initialize`` with the config dict of ``deepspeed_config`` (ZeRO stage,
  bf16/fp16, CPU or NVMe offload, buckets, micro-batch and accumulation);
* DDP (``apply_ddp``) for stage 0.

Users with their own launcher take the same decisions as files: ``export_deepspeed_json`` and
``export_accelerate_config`` (accelerate's YAML for FSDP2 or DeepSpeed).

``validate_offload`` checks before training what would otherwise fail mid-run (NVMe path missing or
not writable, host RAM too small for the offloaded states), each error naming the fix.

Precision mapping. memopt's mixed-precision settings become the engine's own: FSDP2 keeps fp32
sharded parameters and gathers them in bf16/fp16 (``MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32)``),
so no autocast is needed; DeepSpeed's ``bf16``/``fp16`` blocks keep 16-bit weights with fp32 masters.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from memopt.distributed import memory as mem

__all__ = [
    "ENGINES",
    "OFFLOAD_DEVICES",
    "ShardingSetting",
    "apply_ddp",
    "apply_fsdp2",
    "build_deepspeed",
    "deepspeed_config",
    "export_accelerate_config",
    "export_deepspeed_json",
    "mp_policy_for",
    "nvme_swap_bytes",
    "param_swap_buffer_elements",
    "sharding_of",
    "validate_offload",
]

Engine = Literal["ddp", "fsdp2", "deepspeed"]
OffloadDevice = Literal["none", "cpu", "nvme"]
ENGINES: tuple[str, ...] = ("ddp", "fsdp2", "deepspeed")
OFFLOAD_DEVICES: tuple[str, ...] = ("none", "cpu", "nvme")


@dataclass(frozen=True, kw_only=True)
class ShardingSetting:
    """How the model states are spread over ``world_size`` GPUs on ``nodes`` nodes.

    ``stage``: the ZeRO stage (0 = replicated, DDP; 1 = optimizer states, 2 = + gradients, 3 = + parameters
    sharded). FSDP2 is stage 3; ``replicate_size > 1`` makes it hybrid (HSDP): shard over
    ``world_size // replicate_size`` ranks, replicate across ``replicate_size`` groups.
    ``offload_optimizer`` / ``offload_params``: where the sharded optimizer states / parameters live
    (FSDP2's ``CPUOffloadPolicy`` moves both together; NVMe needs DeepSpeed and ``nvme_path``).
    ``reshard_after_forward``: free gathered parameters after each block's forward (stage-3 memory) or keep
    them until backward (less communication, ZeRO-2 parameter memory). ``bucket_bytes``: DeepSpeed's reduce
    and all-gather bucket size in bytes (None: memopt's default of 200 MB, DeepSpeed's own is 1 GB of bf16).
    ``prefetch``: how many blocks ahead are gathered.
    """

    engine: Engine = "fsdp2"
    stage: int = 3
    world_size: int = 1
    nodes: int = 1
    replicate_size: int = 1
    offload_optimizer: OffloadDevice = "none"
    offload_params: OffloadDevice = "none"
    nvme_path: str | None = None
    reshard_after_forward: bool = True
    bucket_bytes: int | None = None
    prefetch: int = 1
    pin_memory: bool = True
    overlap_comm: bool = True

    def __post_init__(self) -> None:
        problems = []
        if self.engine not in ENGINES:
            problems.append(f"engine {self.engine!r} is not one of {list(ENGINES)}")
        if self.stage not in (0, 1, 2, 3):
            problems.append(f"stage must be 0, 1, 2 or 3, got {self.stage!r}")
        if self.engine == "ddp" and self.stage != 0:
            problems.append("engine 'ddp' replicates everything: use stage 0 (or engine 'deepspeed' for ZeRO-1/2)")
        if self.engine == "fsdp2" and self.stage != 3:
            problems.append("engine 'fsdp2' shards parameters, gradients and optimizer states (stage 3); for "
                            "stage 1/2 use engine 'deepspeed', for a ZeRO-2-like FSDP2 set reshard_after_forward=False")
        if self.world_size < 1 or self.nodes < 1 or self.world_size % self.nodes:
            problems.append(f"world_size {self.world_size} must be a positive multiple of nodes {self.nodes}")
        if self.replicate_size < 1 or self.world_size % self.replicate_size:
            problems.append(f"replicate_size {self.replicate_size} must divide world_size {self.world_size}")
        if self.replicate_size > 1 and self.engine != "fsdp2":
            problems.append("hybrid sharding (replicate_size > 1) is applied with FSDP2 only (DeepSpeed 0.19 removed "
                            "MiCS); use engine 'fsdp2'")
        for name in ("offload_optimizer", "offload_params"):
            if getattr(self, name) not in OFFLOAD_DEVICES:
                problems.append(f"{name} {getattr(self, name)!r} is not one of {list(OFFLOAD_DEVICES)}")
        offloads = (self.offload_optimizer, self.offload_params)
        if self.engine == "ddp" and offloads != ("none", "none"):
            problems.append("DDP does not offload; use engine 'fsdp2' (CPU) or 'deepspeed' (CPU or NVMe)")
        if self.engine == "fsdp2":
            if "nvme" in offloads:
                problems.append("FSDP2 offloads to CPU only; NVMe offload needs engine 'deepspeed' (ZeRO-Infinity)")
            elif self.offload_optimizer != self.offload_params:
                problems.append("FSDP2's CPUOffloadPolicy offloads parameters, gradients and the optimizer step "
                                "together: set offload_optimizer and offload_params both to 'cpu' (or both 'none')")
        if self.offload_params != "none" and self.stage != 3:
            problems.append("parameters are offloaded only at stage 3 (offload_params needs stage=3)")
        if "nvme" in offloads and not self.nvme_path:
            problems.append("NVMe offload needs nvme_path: a directory on a local NVMe drive")
        if self.prefetch < 0:
            problems.append(f"prefetch must be >= 0, got {self.prefetch}")
        if self.bucket_bytes is not None and self.bucket_bytes <= 0:
            problems.append(f"bucket_bytes must be positive, got {self.bucket_bytes}")
        if problems:
            raise ValueError("invalid sharding setting: " + "; ".join(problems))

    @property
    def shard_size(self) -> int:
        """Ranks each sharded state is split over."""
        return self.world_size // self.replicate_size

    @property
    def gpus_per_node(self) -> int:
        return self.world_size // self.nodes

    @property
    def offloads(self) -> bool:
        return self.offload_optimizer != "none" or self.offload_params != "none"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_any(cls, value: ShardingSetting | dict[str, Any]) -> ShardingSetting:
        if isinstance(value, ShardingSetting):
            return value
        if isinstance(value, dict):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(f"unknown sharding keys {unknown}; valid keys: {sorted(known)}")
            return cls(**value)
        raise ValueError(f"a sharding setting is a ShardingSetting or a dict, got {type(value).__name__}")

    def label(self) -> str:
        parts = [self.engine if self.engine != "deepspeed" else f"zero{self.stage}", f"x{self.world_size}"]
        if self.replicate_size > 1:
            parts.append(f"hsdp{self.shard_size}x{self.replicate_size}")
        if self.offloads:
            parts.append(f"offload(opt={self.offload_optimizer},params={self.offload_params})")
        if not self.reshard_after_forward:
            parts.append("no-reshard")
        return " ".join(parts)


def sharding_of(plan_or_strategy: Any) -> tuple[Any, ShardingSetting]:
    """The strategy and its sharding setting, from a ``Plan`` or a ``Strategy`` (``extra('sharding')``)."""
    strategy = getattr(plan_or_strategy, "strategy", plan_or_strategy)
    value = strategy.extra("sharding") if hasattr(strategy, "extra") else None
    if value is None:
        raise ValueError("the strategy has no sharding setting: add extras=(('sharding', ShardingSetting(...)),)")
    return strategy, ShardingSetting.from_any(value)


# -- FSDP2 ---------------------------------------------------------------------------------------------
def mp_policy_for(precision: str) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for a memopt precision (None: keep the weights' dtype throughout)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision in ("bf16_autocast", "bf16_master"):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision == "fp16_autocast":
        return MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    return None


def _mesh(setting: ShardingSetting, device_type: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    if setting.replicate_size > 1:
        return init_device_mesh(device_type, (setting.replicate_size, setting.shard_size),
                                mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (setting.world_size,), mesh_dim_names=("shard",))


def apply_fsdp2(model: nn.Module, setting: ShardingSetting, mp_policy: Any = None, block_stacks: Sequence[Any] = (),
                *, device_type: str | None = None, mesh: Any = None) -> Callable[[], None]:
    """``fully_shard`` every block of ``block_stacks`` and then the root; returns an undo.

    ``mp_policy``: a ``MixedPrecisionPolicy``, a ``(param_dtype, reduce_dtype)`` pair or None.
    ``block_stacks``: ``memopt.blocks.BlockStack``s (or lists of modules); found when empty.
    The process group must be initialized with ``world_size`` ranks (or pass a ``mesh``).
    The undo gathers the full weights into every rank (a collective: call it on all ranks),
    replaces the sharded parameters by plain ones and restores the module classes and hooks.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if setting.engine != "fsdp2":
        raise ValueError(f"apply_fsdp2 needs engine 'fsdp2', got {setting.engine!r}")
    if isinstance(mp_policy, tuple):
        mp_policy = MixedPrecisionPolicy(param_dtype=mp_policy[0], reduce_dtype=mp_policy[1])
    mp_policy = mp_policy or MixedPrecisionPolicy()
    if device_type is None:
        first = next(model.parameters(), None)
        device_type = "cpu" if first is None or first.device.type == "meta" else first.device.type
        if device_type == "cpu" and torch.cuda.is_available():
            device_type = "cuda"
    if mesh is None:
        mesh = _mesh(setting, device_type)
    offload = CPUOffloadPolicy(pin_memory=setting.pin_memory) if setting.offload_params == "cpu" else OffloadPolicy()
    if not block_stacks:
        from memopt.blocks import find_block_stacks

        block_stacks = find_block_stacks(model)
    blocks: list[nn.Module] = []
    for stack in block_stacks:
        blocks.extend(getattr(stack, "blocks", stack))
    sharded: list[nn.Module] = []
    try:
        for block in blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=setting.reshard_after_forward, mp_policy=mp_policy,
                        offload_policy=offload)
            sharded.append(block)
        # the root stays gathered from its forward to its backward (FSDP2's default for the root): its
        # backward starts right after its forward ends, so resharding would only add one all-gather
        fully_shard(model, mesh=mesh, reshard_after_forward=None if setting.reshard_after_forward else False,
                    mp_policy=mp_policy, offload_policy=offload)
        sharded.append(model)
    except Exception:
        _unshard_fsdp2(sharded, gather=False)
        raise
    if setting.prefetch > 1 and blocks:
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + setting.prefetch])
            block.set_modules_to_backward_prefetch(blocks[max(0, i - setting.prefetch):i][::-1])

    def undo() -> None:
        _unshard_fsdp2(sharded, gather=True)

    return undo


def _unshard_fsdp2(modules: list[nn.Module], *, gather: bool) -> None:
    from torch.distributed._composable.contract import _get_registry
    from torch.distributed._composable_state import _module_state_mapping
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    done: set[int] = set()
    for module in reversed(modules):
        for sub in module.modules():
            for name, p in list(sub._parameters.items()):
                if p is None or id(p) in done or not isinstance(p, DTensor):
                    continue
                full = p.full_tensor() if gather else p.to_local()
                new = nn.Parameter(full.detach().clone(), requires_grad=p.requires_grad)
                sub._parameters[name] = new
                done.add(id(new))
    for module in modules:
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        for attr in ("_pre_forward_hook_handle", "_post_forward_hook_handle"):
            handle = getattr(state, attr, None)
            if handle is not None:
                handle.remove()
        _module_state_mapping.pop(module, None)
        registry = _get_registry(module)
        if isinstance(registry, dict):
            registry.pop("fully_shard", None)
        module.__class__ = next(b for b in type(module).__bases__ if b is not FSDPModule)


def apply_ddp(model: nn.Module, setting: ShardingSetting, *, device_ids: list[int] | None = None) -> nn.Module:
    """Wrap in ``DistributedDataParallel`` with gradient buckets as views of the gradients (no extra copy)."""
    from torch.nn.parallel import DistributedDataParallel

    if setting.engine != "ddp":
        raise ValueError(f"apply_ddp needs engine 'ddp', got {setting.engine!r}")
    kw: dict[str, Any] = {"gradient_as_bucket_view": True}
    if setting.bucket_bytes:
        kw["bucket_cap_mb"] = setting.bucket_bytes / 2**20
    return DistributedDataParallel(model, device_ids=device_ids, **kw)


# -- DeepSpeed -----------------------------------------------------------------------------------------
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
                     "stage3_max_live_parameters": mem.DS_DEFAULT_MAX_LIVE,
                     # parameters swapped in from NVMe hold one swap buffer each until released: kept for reuse,
                     # they exhaust the buffers ("Not enough buffers 0 for swapping 1", DeepSpeed 0.19.8)
                     "stage3_max_reuse_distance": mem.DS_DEFAULT_MAX_LIVE
                     if setting.reshard_after_forward and setting.offload_params != "nvme" else 0,
                     "stage3_gather_16bit_weights_on_model_save": True})
    if setting.offload_optimizer == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": setting.pin_memory}
    elif setting.offload_optimizer == "nvme":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": setting.nvme_path,
                                     "pin_memory": setting.pin_memory,
                                     "buffer_count": mem.DS_OPTIMIZER_SWAP_BUFFER_COUNT, "fast_init": False}
    if setting.offload_params == "cpu":
        zero["offload_param"] = {"device": "cpu", "pin_memory": setting.pin_memory}
    elif setting.offload_params == "nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": setting.nvme_path, "pin_memory": setting.pin_memory,
                                 "buffer_count": mem.DS_PARAM_SWAP_BUFFER_COUNT,
                                 "buffer_size": param_swap_buffer_elements(setting, largest_param),
                                 # DeepSpeed's default (1e9) swaps the first 1e9 elements "permanently to CPU"
                                 # (stage3.py): the parameters would take host RAM the plan gave to NVMe
                                 "max_in_cpu": 0}
    if setting.stage == 3 and setting.offloads:
        zero["sub_group_size"] = mem.DS_SUB_GROUP_SIZE
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
    return max(mem.DS_PARAM_SWAP_BUFFER_SIZE, part)


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


# -- exports -------------------------------------------------------------------------------------------
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


# -- checks before training ----------------------------------------------------------------------------
def machine_host_memory_bytes() -> int:
    """This machine's RAM: ``MEMOPT_HOST_MEMORY`` (e.g. "128GiB", for VMs whose reported memory grows on use) or
    the OS's physical pages (0 when the OS does not say)."""
    from memopt.units import parse_bytes

    if os.environ.get("MEMOPT_HOST_MEMORY"):
        return parse_bytes(os.environ["MEMOPT_HOST_MEMORY"])
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def machine_host_taken_bytes(reclaimable_bytes: int = 0) -> int:
    """RAM of this machine that its other processes and this one already hold, less ``reclaimable_bytes`` (the
    model's own host copy, freed when the engine moves it to the GPU): what offloaded states cannot have.
    0 where the OS does not say (no ``/proc/meminfo``) or ``MEMOPT_HOST_MEMORY`` overrides the machine's figure."""
    if os.environ.get("MEMOPT_HOST_MEMORY"):
        return 0
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0
    return max(0, machine_host_memory_bytes() - available - reclaimable_bytes)


def validate_offload(setting: ShardingSetting, host_ram_bytes: int | None = None, *, num_params: int | None = None,
                     precision: str = "bf16_autocast", optimizer: str = "adamw_fused",
                     nvme_free_bytes: int | None = None, headroom: float = 0.9) -> dict[str, int]:
    """Raise ``ValueError`` (naming the fix) when an offload setting cannot work on this machine.

    Checks: the NVMe path exists, is a directory and is writable (a probe file is written and removed),
    has room for the swapped states; host RAM per node (``host_ram_bytes``, e.g. ``HardwareSpec.host_memory_bytes``)
    holds the offloaded states and pinned buffers with ``1 - headroom`` left for everything else.
    Returns the host and NVMe bytes per node it checked.
    """
    need: dict[str, int] = {"host_bytes": 0, "nvme_bytes": 0}
    if num_params is not None:
        sb = mem.state_bytes(setting.engine, precision, optimizer)
        m = mem.sharded_memory(num_params, engine=setting.engine, stage=setting.stage, world_size=setting.world_size,
                               sb=sb, nodes=setting.nodes, replicate_size=setting.replicate_size,
                               offload_optimizer=setting.offload_optimizer, offload_params=setting.offload_params)
        need = {"host_bytes": m.host_bytes, "nvme_bytes": m.nvme_bytes, "host_pinned_bytes": m.host_pinned_bytes}
    if "nvme" in (setting.offload_optimizer, setting.offload_params):
        path = Path(setting.nvme_path or "")
        if not setting.nvme_path or not path.exists():
            raise ValueError(f"nvme_path {setting.nvme_path!r} does not exist: create the directory on a local NVMe "
                             "drive (mkdir -p) or set nvme_path to one that exists")
        if not path.is_dir():
            raise ValueError(f"nvme_path {str(path)!r} is not a directory: point it at a directory on the NVMe drive")
        try:
            with tempfile.NamedTemporaryFile(dir=path, prefix=".memopt_probe_", delete=True) as f:
                f.write(b"\0" * 4096)
                f.flush()
        except OSError as exc:
            raise ValueError(f"nvme_path {str(path)!r} is not writable ({exc.strerror}): fix its permissions "
                             "(chown/chmod) or choose a directory this user can write") from exc
        free = nvme_free_bytes if nvme_free_bytes is not None else shutil.disk_usage(path).free
        if need["nvme_bytes"] and need["nvme_bytes"] > free:
            raise ValueError(f"nvme_path {str(path)!r} has {free / 1e9:.1f} GB free but the swapped states need "
                             f"{need['nvme_bytes'] / 1e9:.1f} GB per node: free space, use a larger drive, "
                             "or add nodes")
    if host_ram_bytes is not None and need["host_bytes"]:
        usable = int(host_ram_bytes * headroom)
        if need["host_bytes"] > usable:
            fixes = ["add nodes (each holds 1/nodes of the states)"]
            if setting.engine == "deepspeed" and setting.offload_params != "nvme":
                fixes.append("offload to NVMe instead (offload_params/offload_optimizer='nvme' with an nvme_path)")
            elif setting.engine == "fsdp2":
                fixes.append("switch to engine 'deepspeed' with NVMe offload (ZeRO-Infinity)")
            if setting.offload_params != "none":
                fixes.append("keep the parameters on the GPUs (offload_params='none') if they fit")
            raise ValueError(
                f"offloading needs {need['host_bytes'] / 1e9:.1f} GB of host RAM per node "
                f"({need.get('host_pinned_bytes', 0) / 1e9:.1f} GB pinned) but only {usable / 1e9:.1f} GB of "
                f"{host_ram_bytes / 1e9:.1f} GB is usable: " + ", or ".join(fixes))
    return need


def nvme_swap_bytes(nvme_path: str | os.PathLike[str]) -> dict[str, int]:
    """Bytes of DeepSpeed's swap files under ``nvme_path`` (what ZeRO-Infinity wrote there), by kind.

    DeepSpeed 0.19 writes ``zero_stage_3/<dtype>params/rank<r>/<id>_param.tensor.swp`` (one file per parameter
    partition of at least 1 MiB, in the 16-bit dtype) and ``zero_stage_3/optimizer/rank<r>/<id>.tensor.swp`` (the
    fp32 master partition and each optimizer state of a sub-group), each padded to 1 KiB (its I/O alignment).
    Returns ``params``, ``optimizer``, ``other`` (e.g. gradient swap files) and ``total`` bytes, and ``files``.
    """
    out = {"params": 0, "optimizer": 0, "other": 0, "total": 0, "files": 0}
    root = Path(nvme_path)
    for f in root.rglob("*.swp"):
        parts = f.relative_to(root).parts
        kind = "optimizer" if "optimizer" in parts else "params" if any(p.endswith("params") for p in parts) else \
            "other"
        if kind == "optimizer" and "_gradient_" in f.name:
            kind = "other"
        size = f.stat().st_size
        out[kind] += size
        out["total"] += size
        out["files"] += 1
    return out
