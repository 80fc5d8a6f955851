"""The sharding setting: how the model states are spread over GPUs and nodes and where they are offloaded.

A ``ShardingSetting`` rides in a ``Strategy`` as ``strategy.extra("sharding")`` (a ``ShardingSetting`` or its
dict); ``sharding_of`` reads it back from a plan or a strategy. The setting is kept apart from what applies it
(``memopt.distributed.torch_engines`` for FSDP2 and DDP, ``memopt.distributed.deepspeed_engine`` for DeepSpeed),
what writes it for other launchers (``memopt.distributed.config_export``) and what checks it against this machine
(``memopt.distributed.host_tier``), so that the planner, the estimate and ``Strategy.label`` can read and validate
it without importing an engine or the distributed runtime.

:func:`sharding_settings` lists the settings worth planning on a number of GPUs and nodes, in the order the sharded
planner (``memopt.plan.sharded``) tries them; the registry's sharding entry (``memopt.techniques.extras``) offers
them as its options. ``PLAN_PRECISION``, ``ENGINE_PRECISION`` and ``ENGINE_OPTIMIZER`` say what every engine setting
runs: a sharded plan does not choose its precision or optimizer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "ENGINES",
    "ENGINE_OPTIMIZER",
    "ENGINE_PRECISION",
    "OFFLOAD_DEVICES",
    "PLAN_PRECISION",
    "ShardingSetting",
    "sharding_of",
    "sharding_settings",
]

Engine = Literal["ddp", "fsdp2", "deepspeed"]
OffloadDevice = Literal["none", "cpu", "nvme"]
ENGINES: tuple[str, ...] = ("ddp", "fsdp2", "deepspeed")
OFFLOAD_DEVICES: tuple[str, ...] = ("none", "cpu", "nvme")

#: the precision a sharded plan's strategy names (and the policy allowance it needs): the engines' own mixed
#: precision, bf16 compute with fp32 master weights and reductions
PLAN_PRECISION = "bf16_autocast"
#: the precision memopt's profile is traced in for the engines' compute (bf16 weights, no autocast)
ENGINE_PRECISION = "bf16_pure"
#: the optimizer a sharded plan names: AdamW (DeepSpeed's own AdamW, or its CPUAdam where it offloads; torch's
#: fused AdamW under FSDP2 and DDP)
ENGINE_OPTIMIZER = "adamw_fused"


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


def sharding_settings(world_size: int, nodes: int, *, nvme_path: str | None = None) -> Iterator[ShardingSetting]:
    """Every engine setting worth planning on ``world_size`` GPUs over ``nodes`` nodes, in the order the sharded
    planner tries them (its runners-up keep this order among equally fast settings).

    One GPU: only the offloading ones (ZeRO-Offload, ZeRO-3 with CPU/NVMe offload, FSDP2 ``CPUOffloadPolicy``);
    without offload one GPU is the single-GPU search's. Several: DDP, ZeRO-1/2/3 (with and without offload),
    FSDP2 full shard and, across nodes, hybrid shard (shard within a node, replicate across nodes). NVMe offload
    only with an ``nvme_path``.
    """
    common: dict[str, Any] = {"world_size": world_size, "nodes": nodes}
    devices = ["cpu"] + (["nvme"] if nvme_path else [])
    if world_size > 1:
        yield ShardingSetting(engine="ddp", stage=0, **common)
        for stage in (1, 2):
            yield ShardingSetting(engine="deepspeed", stage=stage, **common)
        yield ShardingSetting(engine="deepspeed", stage=3, **common)
        yield ShardingSetting(engine="fsdp2", stage=3, **common)
        if nodes > 1:
            yield ShardingSetting(engine="fsdp2", stage=3, replicate_size=nodes, **common)
    yield ShardingSetting(engine="deepspeed", stage=2, offload_optimizer="cpu", **common)
    for dev in devices:
        path = nvme_path if dev == "nvme" else None
        yield ShardingSetting(engine="deepspeed", stage=3, offload_optimizer=dev, nvme_path=path, **common)  # type: ignore[arg-type]
        yield ShardingSetting(engine="deepspeed", stage=3, offload_optimizer=dev, offload_params=dev,  # type: ignore[arg-type]
                              nvme_path=path, **common)
    yield ShardingSetting(engine="fsdp2", stage=3, offload_optimizer="cpu", offload_params="cpu", **common)


def sharding_of(plan_or_strategy: Any) -> tuple[Any, ShardingSetting]:
    """The strategy and its sharding setting, from a ``Plan`` or a ``Strategy`` (``extra('sharding')``)."""
    strategy = getattr(plan_or_strategy, "strategy", plan_or_strategy)
    value = strategy.extra("sharding") if hasattr(strategy, "extra") else None
    if value is None:
        raise ValueError("the strategy has no sharding setting: add extras=(('sharding', ShardingSetting(...)),)")
    return strategy, ShardingSetting.from_any(value)
