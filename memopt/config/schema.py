"""Structured configs of the dry run ``python -m memopt.plan`` (registered in Hydra's ConfigStore by
:mod:`memopt.config.store`).

The YAML groups under ``configs/`` fill these nodes::

    model:     configs/model/*.yaml      a model spec, or a _target_ node for your own nn.Module
    hardware:  configs/hardware/*.yaml   the fields of memopt.hardware.HardwareSpec ("auto": the local GPU)
    policy:    configs/policy/*.yaml     fidelity, pins, forbid, margin, max_micro_batch
    training:  configs/training/*.yaml   the sample shape (null: the model's typical sample) and optimizer

Types are deliberately loose where the planner accepts several forms (a budget is "40GB", "80%" or a byte
count; fidelity is a preset or a list of allowances): :func:`memopt.config.validate.validate` checks the
values and reports every problem at once, naming what would be valid.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["OUTPUTS", "ForbidConfig", "HardwareConfig", "ModelConfig", "OptimizerKwargs", "PinsConfig", "PlanConfig",
           "PolicyConfig", "TrainingConfig"]

#: what ``output=`` may be
OUTPUTS: tuple[str, ...] = ("table", "json")


@dataclass
class ModelConfig:
    """A model spec (see :mod:`memopt.models.spec`): ``name``, ``family``, ``architecture``, ``hf_config`` and a
    typical training ``sample`` -- or ``_target_`` naming a callable that builds your own ``torch.nn.Module``
    (called with ``kwargs``, on the meta device), with ``inputs`` describing one example of its batch:
    ``{name: {shape: [...], dtype: float32}}`` (shape without the batch dimension) and optionally
    ``loss_fn``, a dotted path to ``(output, batch) -> loss`` when the output has no ``.loss``."""

    name: str | None = None
    family: str | None = None
    architecture: str | None = None
    hf_config: dict[str, Any] = field(default_factory=dict)
    sample: dict[str, Any] = field(default_factory=dict)
    _target_: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    inputs: dict[str, Any] = field(default_factory=dict)
    loss_fn: str | None = None


@dataclass
class HardwareConfig:
    """One GPU (the fields of :class:`memopt.hardware.HardwareSpec`). ``name: auto`` with nothing else set
    plans for the local GPU. Byte fields accept sizes such as ``80GiB``."""

    name: str = "auto"
    memory_bytes: Any = None
    compute_capability: list[int] | None = None
    peak_flops: dict[str, float] | None = None
    hbm_bandwidth: float | None = None
    host_link_bandwidth: float | None = None
    runtime_overhead_bytes: Any = None
    num_sms: int | None = None
    gpus_per_node: int | None = None
    num_nodes: int | None = None
    intra_node_bandwidth: float | None = None
    inter_node_bandwidth: float | None = None
    host_memory_bytes: Any = None
    notes: str | None = None
    # nvme_path is declared so that the documented `hardware.extra.nvme_path=/mnt/nvme` works without a `+`
    extra: dict[str, Any] = field(default_factory=lambda: {"nvme_path": None})


@dataclass
class PinsConfig:
    """Techniques pinned to one value (null: the planner chooses). The keys are memopt.plan.policy.PINNABLE."""

    precision: Any = None  # fp32 | bf16_autocast | fp16_autocast | bf16_master | bf16_pure
    checkpointing: Any = None  # none | full | selective
    checkpoint_blocks: Any = None  # how many blocks of each stack to checkpoint (an int)
    activation_offload: Any = None  # true | false
    attention: Any = None  # auto | flash | efficient | cudnn | math | flash_attn
    chunked_ce: Any = None  # chunks of a fused linear + cross-entropy head; 0 = off
    ce_kernel: Any = None  # memopt | liger: the fused head's kernel (liger: Liger-kernel, CUDA only)
    optimizer: Any = None  # a name of memopt.techniques.optimizers.VARIANTS (adamw_fused, adamw8bit, ...)
    micro_batch_size: Any = None  # an int dividing the global batch
    expandable_segments: Any = None  # true | false
    adapter_rank: Any = None  # LoRA rank (needs fidelity 'lora'); 0 = full fine-tuning, no adapters
    quant_bits: Any = None  # 4 | 8: frozen base quantized (needs fidelity 'qlora'); 0 = unquantized
    offload: Any = None  # false: never offload model states (true: only plans that offload)


@dataclass
class ForbidConfig:
    """Values a technique must not take (a value or a list; null: nothing forbidden)."""

    precision: Any = None
    checkpointing: Any = None
    checkpoint_blocks: Any = None
    activation_offload: Any = None
    attention: Any = None
    chunked_ce: Any = None
    ce_kernel: Any = None
    optimizer: Any = None
    micro_batch_size: Any = None
    expandable_segments: Any = None
    adapter_rank: Any = None
    quant_bits: Any = None
    offload: Any = None
    loss_scaling: Any = None  # grad_scaler: forbids fp16 autocast, which needs it


@dataclass
class PolicyConfig:
    """What the planner may change (see :mod:`memopt.plan.policy`).

    ``fidelity``: a preset (exact, default, mixed, 8bit, lossy, lora, qlora) or a list of allowances;
    ``pins``: technique -> the value it must take (``precision: bf16_autocast``, ``checkpointing: full``,
    ``micro_batch_size: 2``, ``quant_bits: 4``);
    ``forbid``: technique -> values it must not take; ``margin``: memory kept free (``3%`` or ``1GiB``; null:
    2% of the budget + 256 MiB); ``max_micro_batch``: the largest micro-batch to try."""

    fidelity: Any = "default"
    pins: PinsConfig = field(default_factory=PinsConfig)
    forbid: ForbidConfig = field(default_factory=ForbidConfig)
    margin: Any = None
    max_micro_batch: int | None = None


@dataclass
class OptimizerKwargs:
    """Hyper-parameters of the training run's optimizer (null: the optimizer's default). They do not change
    the memory a step needs, so the plan does not depend on them; they travel with the config."""

    lr: float | None = None
    weight_decay: float | None = None
    betas: list[float] | None = None
    eps: float | None = None
    momentum: float | None = None  # sgd; planned with a momentum buffer
    nesterov: bool | None = None
    dampening: float | None = None


@dataclass
class TrainingConfig:
    """The global batch planned for, and the optimizer.

    Shapes left null come from the model's typical ``sample``. ``variable_length: true`` says batches vary in
    length (padded per batch, or packed to at most ``seq_len``): the plan is made for the longest, ``seq_len``.
    ``optimizer``: ``auto`` lets the planner choose the AdamW implementation (and 8-bit states when the
    policy allows them); a memopt name (``memopt.techniques.optimizers.VARIANTS``: adamw_fused, adamw_foreach,
    adamw, sgd, adamw8bit, paged_adamw8bit, torchao_adamw8bit, torchao_adamw4bit) pins it. ``optimizer_kwargs``
    (lr, weight_decay, betas, eps, momentum ...) are the training run's; they do not change memory."""

    batch_size: int | None = None
    seq_len: int | None = None
    image_size: int | None = None
    decoder_seq_len: int | None = None
    variable_length: bool | None = None
    optimizer: str = "auto"
    optimizer_kwargs: OptimizerKwargs = field(default_factory=OptimizerKwargs)


@dataclass
class PlanConfig:
    """``python -m memopt.plan``: plan ``model`` x ``training`` on ``hardware`` within ``budget`` per GPU."""

    model: ModelConfig = field(default_factory=ModelConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    budget: Any = "24GB"  # "40GB" (10^9), "40GiB"/"40G" (2^30), "80%" of the GPU, or bytes
    output: str = "table"  # table | json
    save_plan: str | None = None  # write the plan as JSON here (a multirun job saves into its own folder)
    use_cache: bool = True  # reuse profiles under $MEMOPT_CACHE_DIR (default ~/.cache/memopt)
    calibration: str = "use"  # use | ignore | clear: measured/predicted ratios of earlier runs (estimate.calibration)
