"""``memopt.wrap`` for a sharded or offloaded plan: the model sharded as planned, the same ``step(batch)``.

Each process of a ``torchrun`` (or ``deepspeed`` / ``accelerate launch``) job calls ``memopt.wrap(model, plan=plan)``
with a plan whose strategy carries a sharding setting (``memopt.plan`` with ``world_size=``/``hardware.gpus_per_node``,
or one-GPU offload). What is applied, in this order (each step needs the one before):

1. the run is checked against the plan: the world size the plan was made for, the process group;
2. activation checkpointing on the planned blocks (``memopt.techniques.checkpointing``), before sharding, so FSDP2's
   units wrap the checkpointed blocks as the estimate assumed;
3. the engine: FSDP2 ``fully_shard`` per block and root with the plan's mixed-precision policy (and
   ``CPUOffloadPolicy`` when offloading), then torch AdamW on the shards; or ``deepspeed.initialize`` with the
   generated config (ZeRO stage, offload, buckets, micro-batch and accumulation); or DDP;
4. ``DistributedTrainStep``: exact token-weighted accumulation over the plan's micro-batches.

On one GPU (an offload plan) no launcher is needed: a one-process group is started in the process
(``single_process_group``) and ``memopt.wrap(model, budget=..., sample=...)`` applies the plan it made.

``step(batch)`` takes this rank's share of the global batch (what a ``DistributedSampler`` delivers), or the whole
global batch, which it splits by rank.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memopt.blocks import find_block_stacks
from memopt.distributed.checkpoint import load_checkpoint, load_sharded, save_checkpoint
from memopt.distributed.deepspeed_engine import build_deepspeed
from memopt.distributed.ds_checkpoint import CHECKPOINT_META, load_deepspeed, save_deepspeed
from memopt.distributed.ds_load import load_into_deepspeed_layout
from memopt.distributed.torch_engines import apply_ddp, apply_fsdp2, mp_policy_for
from memopt.distributed.train_step import DistributedTrainStep, shard_batch
from memopt.models.hf_task import is_causal_lm
from memopt.step.batch import check_batch
from memopt.step.hard_cap import cap_to_plan, set_expandable_segments
from memopt.step.loss_reduction import LossReduction
from memopt.step.prepare import disable_kv_cache, disable_own_checkpointing
from memopt.techniques.checkpointing import apply_checkpointing
from memopt.techniques.precision import cast_float_inputs
from memopt.techniques.sharding import ShardingSetting, sharding_of

__all__ = ["ShardedWrapped", "end_single_process_group", "is_sharded_plan", "single_process_group"]


def is_sharded_plan(plan: Any) -> bool:
    """Whether ``plan`` (a ``Plan`` or ``None``) carries a sharding setting."""
    strategy = getattr(plan, "strategy", None)
    return strategy is not None and strategy.extra("sharding") is not None


def single_process_group(device: torch.device) -> list[str] | None:
    """Start a one-process ``torch.distributed`` group (world size 1) when none exists, so that a one-GPU offload
    plan's engine (DeepSpeed or FSDP2) runs in a plain ``python`` process. The group's store lives in this process
    (no port is opened); the launcher variables the engines read are set where absent. Returns the variables it
    set when it started a group (``end_single_process_group`` takes them back), None when a group existed. A process
    that a launcher started as one rank of several is refused: its group must be the launcher's."""
    import torch.distributed as dist

    if not dist.is_available():
        raise ValueError("this PyTorch build has no torch.distributed, which a one-GPU offload plan's engine needs: "
                         "install a build with it, or pin offload=False")
    if dist.is_initialized():
        return None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != 1:
        raise ValueError(f"WORLD_SIZE={world} says this process is one rank of a launched job, but torch.distributed "
                         "is not initialized: call torch.distributed.init_process_group first (torchrun does)")
    env_set = []
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        if name not in os.environ:
            os.environ[name] = value
            env_set.append(name)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    try:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    except BaseException:
        end_single_process_group(env_set)
        raise
    return env_set


def end_single_process_group(env_set: list[str]) -> None:
    """Destroy the group ``single_process_group`` started and take back the launcher variables it set: left behind,
    every later library in the process (accelerate, a Trainer) would take the process for one rank of a job."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    for name in env_set:
        os.environ.pop(name, None)


def _world() -> tuple[int, int, int]:
    """(rank, local rank, world size) of this process."""
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank(), int(os.environ.get("LOCAL_RANK", dist.get_rank())), dist.get_world_size()
    return 0, 0, 1


class ShardedWrapped:
    """The prepared pieces of a sharded run: ``.model`` (FSDP2 module, DDP module or DeepSpeed engine),
    ``.optimizer``, ``.plan``, ``.setting``, ``.step(batch) -> float``."""

    def __init__(self, model: nn.Module, plan: Any, *, optimizer_kwargs: dict[str, Any] | None = None,
                 loss_fn: Any = None, device: Any = None, max_grad_norm: float | None = None,
                 lr_scheduler: Any = None, checkpoint: Any = None, cap_budget_bytes: int | None = None,
                 loss_reduction: LossReduction | None = None) -> None:
        strategy, setting = sharding_of(plan)
        self.plan, self.setting = plan, setting
        self.rank, local, world = _world()
        if world != setting.world_size:
            raise ValueError(f"the plan shards over {setting.world_size} GPU(s) but this run has {world} process(es): "
                             f"launch with torchrun --nproc-per-node {setting.gpus_per_node}"
                             + (f" --nnodes {setting.nodes}" if setting.nodes > 1 else "")
                             + f", or re-plan with world_size={world}")
        if setting.world_size > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise ValueError("a sharded plan needs torch.distributed initialized (torchrun does it; or call "
                                 "torch.distributed.init_process_group first)")
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu"))
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._checkpoint = None if checkpoint is None else (
            [checkpoint] if isinstance(checkpoint, (str, os.PathLike)) else list(checkpoint))
        if self._checkpoint is None and any(p.device.type == "meta" for p in model.parameters()):
            raise ValueError("the model's parameters are on the meta device: pass checkpoint=<safetensors file(s)> "
                             "to load them into the sharded layout, or build the model with its weights")
        # one GPU: the engine still wants a process group; one of a single process is started here, not by the user
        started = single_process_group(self.device) if setting.world_size == 1 else None
        self.started_group = started is not None
        self._env_set = started or []
        undo: list[Any] = []
        try:
            self._build(model, plan, strategy, setting, undo, optimizer_kwargs=optimizer_kwargs, loss_fn=loss_fn,
                        max_grad_norm=max_grad_norm, lr_scheduler=lr_scheduler, cap_budget_bytes=cap_budget_bytes,
                        loss_reduction=loss_reduction)
        except BaseException:
            # nothing of a wrap that failed stays: the model as it was given, no process group of memopt's
            while undo:
                undo.pop()()
            self.close()
            raise

    def _build(self, model: nn.Module, plan: Any, strategy: Any, setting: ShardingSetting, undo: list[Any], *,
               optimizer_kwargs: dict[str, Any] | None, loss_fn: Any, max_grad_norm: float | None,
               lr_scheduler: Any, cap_budget_bytes: int | None, loss_reduction: LossReduction | None) -> None:
        """The cap, the model's changes (their undos pushed on ``undo``), the engine and the train step."""
        self.cap_fraction: float | None = None
        if self.device.type == "cuda":  # the budget holds here as in memopt.wrap: allocator mode, then the hard cap
            set_expandable_segments(strategy.expandable_segments)
            self.cap_fraction = cap_to_plan(cap_budget_bytes or plan.budget_bytes,
                                            int(plan.prediction.get("runtime_bytes", 0)), self.device)
        self._causal_lm = is_causal_lm(model)  # before an engine wraps it
        # no KV cache in training, as in memopt's one-GPU step and in the profile the plan was traced from: a
        # checkpointed block would otherwise keep its keys and values alive until the loss
        undo.append(disable_kv_cache(model))
        # the plan decides which blocks recompute, as it was traced: not a model's own gradient checkpointing
        undo.append(disable_own_checkpointing(model))
        stacks = find_block_stacks(model)
        undo.append(apply_checkpointing(stacks, strategy.checkpointing))
        self._opt_kwargs = {"lr": 1e-4, **(optimizer_kwargs or {})}
        self._max_grad_norm, self._lr_scheduler = max_grad_norm, lr_scheduler
        # pretrained weights for a model built on the meta device (self._checkpoint): read into the engine's layout
        # tensor by tensor
        self.model, self.optimizer, step_kw = self._engine(model, setting, strategy, stacks)
        if "engine" not in step_kw:  # DeepSpeed clips and schedules inside its engine (its config / initialize)
            step_kw.update(max_grad_norm=max_grad_norm,
                           lr_scheduler=lr_scheduler(self.optimizer) if lr_scheduler is not None else None)
        self._step = DistributedTrainStep(model=self.model, optimizer=self.optimizer, strategy=strategy,
                                          device_type=self.device.type, device=self.device, loss_fn=loss_fn,
                                          world_size=setting.world_size, causal_lm=self._causal_lm,
                                          reduction=loss_reduction, **step_kw)

    def _engine(self, model: nn.Module, setting: ShardingSetting, strategy: Any, stacks: Any
                ) -> tuple[Any, Any, dict[str, Any]]:
        if setting.engine == "deepspeed":
            # DeepSpeed's bf16/fp16 engine stores the weights in half precision and runs no autocast: the model takes
            # its floating-point inputs in that dtype, as memopt's own half-precision weights do (and the profile
            # traced); FSDP2's mixed-precision policy casts them itself
            half = {"fp16_autocast": torch.float16}.get(strategy.precision, torch.bfloat16)
            if strategy.precision != "fp32":
                cast_float_inputs(model, half)
            params = {k: list(v) if isinstance(v, tuple) else v for k, v in self._opt_kwargs.items()}
            optimizer_cfg = {"type": "AdamW", "params": params}
            engine, optimizer = build_deepspeed(model, setting, strategy.precision, optimizer_cfg,
                                                micro_batch=strategy.micro_batch_size,
                                                grad_accum=strategy.grad_accum_steps,
                                                gradient_clipping=self._max_grad_norm, lr_scheduler=self._lr_scheduler,
                                                checkpoint=self._checkpoint, load_device=self.device)
            return engine, optimizer, {"engine": engine}
        if self._checkpoint is not None and setting.engine == "fsdp2":
            # each rank reads only its shard's rows; with CPUOffloadPolicy the shards live in host memory
            load_sharded(model, self._checkpoint, setting, mp_policy=mp_policy_for(strategy.precision),
                         block_stacks=stacks, device="cpu" if setting.offload_params == "cpu" else self.device)
            return model, self._adamw(model), {"kind": "fsdp2"}
        if self._checkpoint is not None:  # DDP: every rank holds the whole model on its device anyway
            load_into_deepspeed_layout(model, self._checkpoint, {}, self.device)
        if setting.engine == "ddp":
            model = apply_ddp(model.to(self.device), setting,
                              device_ids=[self.device.index] if self.device.type == "cuda" else None)
            return model, self._adamw(model), {"kind": "ddp", "engine_precision": False}
        if setting.offload_params == "none":
            model.to(self.device)
        apply_fsdp2(model, setting, mp_policy_for(strategy.precision), stacks, device_type=self.device.type)
        return model, self._adamw(model), {"kind": "fsdp2"}

    def _adamw(self, model: nn.Module) -> torch.optim.Optimizer:
        on_gpu = self.device.type == "cuda" and self.setting.offload_params == "none"
        return torch.optim.AdamW(model.parameters(), **self._opt_kwargs,
                                 **({"fused": True} if on_gpu else {"foreach": True}))

    def step(self, batch: Any) -> float:
        """One optimizer step; ``batch`` (any structure of ``memopt.step.batch``) is this rank's share of the
        global batch, or the whole global batch."""
        global_batch = int(getattr(self.plan, "global_batch", 0))
        if self.setting.world_size > 1 and check_batch(batch) == global_batch:
            batch = shard_batch(batch, self.rank, self.setting.world_size)
        return self._step.step(batch)

    @property
    def samples_seen(self) -> int:
        return self._step.samples_seen

    def close(self) -> None:
        """End the run as ``memopt.wrap``'s one-GPU wrapper does: the one-process group started for a one-GPU
        engine is destroyed (a group the user or the launcher started stays theirs). The engine cannot step after
        it; ``save`` first to keep the training state."""
        if self.started_group:
            end_single_process_group(self._env_set)
            self.started_group = False

    @property
    def steps_done(self) -> int:
        return self._step.steps_done

    # -- checkpoints (every rank calls these) ---------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write a checkpoint that resumes on another world size or plan: parameters, optimizer states, the step
        and the data position (``samples_seen``). FSDP2 / DDP: ``torch.distributed.checkpoint``; DeepSpeed: its
        own checkpoint (``memopt.distributed.ds_checkpoint``). Returns the checkpoint folder."""
        out = Path(path)
        if self.setting.engine == "deepspeed":
            save_deepspeed(self.model, out, stage=self.setting.stage, world_size=self.setting.world_size,
                           steps_done=self.steps_done, samples_seen=self.samples_seen)
        else:
            save_checkpoint(out, self.model, self.optimizer, self._step, lr_scheduler=self._step.lr_scheduler)
        return out

    def load(self, path: str | os.PathLike[str]) -> dict[str, int]:
        """Resume from ``save``'s checkpoint, written at this or another world size (and, for DeepSpeed, ZeRO
        stage). Returns and restores ``steps_done`` and ``samples_seen``: feed the data from there."""
        written_by_deepspeed = (Path(path) / CHECKPOINT_META).is_file()
        if written_by_deepspeed != (self.setting.engine == "deepspeed"):
            theirs = "DeepSpeed" if written_by_deepspeed else "FSDP2/DDP (torch.distributed.checkpoint)"
            raise ValueError(f"{path} was written by {theirs} and this plan trains with {self.setting.engine}: "
                             "a checkpoint does not cross engines. Resume with the plan that wrote it "
                             "(memopt.wrap(model, plan='<that plan>.json')) or another plan on the same engine; "
                             "DeepSpeed plans may change ZeRO stage and world size, FSDP2 plans the world size")
        if self.setting.engine == "deepspeed":
            counters = load_deepspeed(self.model, path, stage=self.setting.stage, world_size=self.setting.world_size)
            self._step.steps_done = counters["steps_done"]
            self._step.samples_seen = counters["samples_seen"]
            return counters
        return load_checkpoint(path, self.model, self.optimizer, self._step, lr_scheduler=self._step.lr_scheduler)
