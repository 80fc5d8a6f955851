"""The object ``memopt.wrap`` returns for one GPU: :class:`Wrapped` holds the user's model, the plan (made on the
first batch when no sample or saved plan was given), and the pieces that plan applied (``memopt.step.prepare``), and
trains under it -- ``step(batch)`` with the runtime guard's telemetry and OOM recovery, the pieces for a hand-written
loop, ``unwrap()``, and checkpoints. It is an entry-point object (its guard reaches the layers above ``apply``), kept
apart from :func:`memopt.apply.wrap.wrap`, which checks the arguments and picks what to return.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from memopt import progress
from memopt.apply.batch_shape_watch import ShapeWatch, watch_for
from memopt.apply.step_checks import StepChecks
from memopt.apply.wrap_checks import WRAPPED_BY, WrappedBy, check_model, micro_batch_warning
from memopt.apply.wrap_planning import plan_for_room_left, planning_pins, refuse_unfit
from memopt.apply.wrapped_autotune import WrappedAutotune
from memopt.apply.wrapped_checkpoints import WrappedCheckpoints
from memopt.guard.escalation import PlanEscalator, step_down
from memopt.guard.reapply import PreparedReplanner
from memopt.guard.runtime import RuntimeGuard
from memopt.plan.context import micro_batch_refusal_for, resolve_hardware, resolve_policy
from memopt.plan.evaluated import ALTERNATIVES_WITHIN
from memopt.plan.planner import make_plan
from memopt.plan.schema import Plan
from memopt.profile.api import profile_model
from memopt.step.batch import check_batch
from memopt.step.batch_samples import indivisible
from memopt.step.hard_cap import (
    cap_to_plan,
    room_taken_on_device,
    set_expandable_segments,
)
from memopt.step.loss_reduction import LossReduction, starting_mode
from memopt.step.prepare import Prepared, prepare
from memopt.step.right_padding import PaddingCut
from memopt.step.train_step import SchedulerStepFailed, count_loss_items
from memopt.techniques.attention import sdpa_restricted
from memopt.techniques.precision import forward_context
from memopt.units import format_bytes

__all__ = ["Wrapped"]


class Wrapped(WrappedCheckpoints, WrappedAutotune):
    """A model, optimizer and plan ready to train: ``step(batch)`` runs one optimizer step."""

    def __init__(self, model: nn.Module, *, budget: Any, sample: Any, plan: Plan | None, optimizer: Any,
                 optimizer_kwargs: dict[str, Any], loss_fn: Any, lr_scheduler: Any, max_grad_norm: float | None,
                 hardware: Any, policy: Any, fidelity: Any, pins: dict[str, Any] | None, forbid: dict[str, Any] | None,
                 device: Any, enforce_budget: bool, use_cache: bool, guard: bool = True,
                 run_dir: str | os.PathLike[str] | None = None, autotune: bool | None = None,
                 checkpoint: Any = None, transaction: str = "auto", calibration: str = "use",
                 loss_reduction: str = "auto", started: float | None = None) -> None:
        self._started = time.perf_counter() if started is None else started
        # seconds from wrap to the start of the first training step: trace, plan, apply and autotune (issue's "time
        # to the first step"; None until the first step)
        self.startup_s: float | None = None
        check_model(model, weights_pending=checkpoint is not None)
        self._checkpoint = checkpoint
        self.load_peak_allocated_bytes: int | None = None  # measured while the checkpoint loaded (CUDA)
        self._user_model = model
        self._budget = budget
        self._plan_budget = budget  # what the planner may use: less than the budget when the device holds memory
        self._cap_budget_bytes: int | None = None  # the cap's budget when the plan's is smaller (set with it)
        self._optimizer_arg = optimizer
        self._optimizer_kwargs = optimizer_kwargs
        self._loss_fn = loss_fn
        self._reduction = LossReduction(starting_mode(model, loss_fn, loss_reduction))
        self._padding = PaddingCut()
        self._lr_scheduler_factory = lr_scheduler
        self._max_grad_norm = max_grad_norm
        self._hardware = hardware
        self._policy_args = {"policy": policy, "fidelity": fidelity, "pins": pins, "forbid": forbid}
        self._enforce_budget = enforce_budget
        self._use_cache = use_cache
        self._prepared: Prepared | None = None
        self._checks = StepChecks(model, optimizer)  # unwrapped or closed; what changed between steps
        self._sharded: Any = None  # a ShardedWrapped when the plan offloads the model states
        self._guard_enabled = guard
        self._run_dir = run_dir
        self._transaction = transaction
        self._calibration = calibration
        self._profile: Any = None
        self._shape_watch: ShapeWatch | None = None
        self.guard: Any = None
        self.plan: Plan | None = plan
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
        self.steps_done = 0
        self.items_seen = 0
        self.attribution_step: int | None = 0  # the step recorded by module into run_dir (None: none)
        # measured choice among the planner's best candidates (memopt.apply.autotune): by default on a GPU when
        # wrap makes the plan itself; never for a saved plan, which is applied unchanged
        self._autotune = (self.device.type == "cuda") if autotune is None else bool(autotune)
        if plan is not None and autotune:
            raise ValueError("autotune=True re-plans, but a saved plan= is applied unchanged: pass one or the other")
        self._autotune_pending = False
        self._plan_pins: dict[str, Any] | None = None
        if plan is None and sample is not None:
            self.plan = self._make_plan(sample)
        if self.plan is not None:
            self._apply(self.plan)
        model.__dict__[WRAPPED_BY] = WrappedBy(self)  # until unwrap(): a second wrap of this module is refused

    # -- planning and applying -------------------------------------------------------------------
    @torch.enable_grad()  # the traces run a backward: a wrap (or a first step) under no_grad plans all the same
    def _make_plan(self, sample: Any) -> Plan:
        if self._budget is None:
            raise ValueError("memopt.wrap needs budget= (e.g. '40GB') or a saved plan= to apply")
        merged_pins, user_opt = planning_pins(self._optimizer_arg, self._policy_args["pins"], self._loss_fn)
        hw = resolve_hardware(self._hardware)
        progress.start(f"profiling {type(self._user_model).__name__} for {hw.name} (fake-tensor traces of the "
                       "training step)")
        self._profile = profile_model(self._user_model, sample, hardware=hw, loss_fn=self._loss_fn, optimizer=user_opt,
                                      use_cache=self._use_cache)
        self._hw = hw
        self._replan = lambda pins: make_plan(  # the autotune's candidates come with it (plan.alternatives)
            self._user_model, sample, budget=self._plan_budget, hardware=hw, policy=self._policy_args["policy"],
            fidelity=self._policy_args["fidelity"], pins=pins or None, forbid=self._policy_args["forbid"],
            optimizer=user_opt, loss_fn=self._loss_fn, profile=self._profile, calibration=self._calibration,
            alternatives_within=ALTERNATIVES_WITHIN if self._autotune else None)
        self._plan_pins = merged_pins
        plan = self._replan(merged_pins)
        if plan.fits and self.device.type == "cuda" and self._enforce_budget:
            taken = room_taken_on_device(self._user_model, int(plan.prediction.get("runtime_bytes", 0)), self.device)
            plan = self._plan_for_room_left(plan, merged_pins, taken) if taken else plan
        refuse_unfit(plan)
        progress.report(f"planned: {plan.strategy.label()} (predicted {format_bytes(plan.total_bytes)} of "
                        f"{format_bytes(plan.budget_bytes)}, {plan.step_time_s:.3f} s/step)")
        if plan.strategy.extra("sharding") is not None and user_opt is not None:
            raise ValueError(f"nothing fits on this GPU alone but a plan that offloads the model states "
                             f"({plan.strategy.label()}), whose engine runs its own AdamW: pass optimizer='adamw' "
                             "(with lr=...), or pin offload=False to see what fits without offload")
        # an offload plan is applied by its engine (one process group of one, started by ShardedWrapped): no
        # autotune among single-GPU candidates, which all failed to fit
        self._autotune_pending = self._autotune and plan.strategy.extra("sharding") is None
        return plan

    def _plan_for_room_left(self, plan: Plan, pins: dict[str, Any], taken: int) -> Plan:
        """Re-plan for what ``taken`` bytes already in use on the device leave of the budget; the cap still takes
        the user's budget, so nothing is subtracted twice."""
        self._cap_budget_bytes = plan.budget_bytes
        self._plan_budget = max(plan.budget_bytes - taken, 0)
        return plan_for_room_left(plan.budget_bytes, taken, lambda: self._replan(pins))

    def _apply(self, plan: Plan) -> None:
        if plan.strategy.extra("sharding") is not None:
            self._apply_sharded(plan)
            return
        strategy = plan.strategy
        cuda = self.device.type == "cuda"
        if cuda:
            set_expandable_segments(strategy.expandable_segments)
        micro_batch_warning(self._user_model, strategy.micro_batch_size, plan.global_batch,
                            self._micro_batch_refusal())
        model = self._user_model
        if cuda:
            torch.cuda.init()
            if self._enforce_budget:
                self.cap_fraction = cap_to_plan(self._cap_budget_bytes or plan.budget_bytes,
                                                int(plan.prediction.get("runtime_bytes", 0)), self.device)
        if self._checkpoint is not None and any(p.device.type == "meta" for p in model.parameters()):
            # lazy: keeps memopt.techniques.quantized_load out of import memopt
            from memopt.techniques.quantized_load import load_for_strategy

            self.load_peak_allocated_bytes = load_for_strategy(model, self._checkpoint, strategy, self.device)
        # gradients left on the model (a sanity-check backward before wrap) would be added to the first step's
        model.zero_grad(set_to_none=True)
        prepare_kwargs = self._prepare_kwargs()
        self._prepared = prepare(model, strategy, **prepare_kwargs)
        if self._guard_enabled:
            self._install_guard(plan, prepare_kwargs)

    def _micro_batch_refusal(self) -> str | None:
        """Why micro-batches would not be exact for this model under the policy wrap was given (random draws in the
        forward count under fidelity 'exact'); None without a profile (a saved plan: its notes said so)."""
        if self._profile is None:
            return None
        return micro_batch_refusal_for(self._profile, resolve_policy(**self._policy_args))

    def _apply_sharded(self, plan: Plan) -> None:
        """A one-GPU offload plan (DeepSpeed or FSDP2 with the states on the host), applied in this process."""
        # lazy: keeps memopt.distributed.wrapped (offload/sharded engines) out of import memopt
        from memopt.distributed.wrapped import ShardedWrapped

        self._sharded = ShardedWrapped(self._user_model, plan, optimizer_kwargs=self._optimizer_kwargs,
                                       loss_fn=self._loss_fn, device=self.device, max_grad_norm=self._max_grad_norm,
                                       lr_scheduler=self._lr_scheduler_factory, checkpoint=self._checkpoint,
                                       cap_budget_bytes=self._cap_budget_bytes, loss_reduction=self._reduction)
        self.cap_fraction = self._sharded.cap_fraction

    def _prepare_kwargs(self) -> dict[str, Any]:
        user_opt = self._optimizer_arg if callable(self._optimizer_arg) and not isinstance(
            self._optimizer_arg, str) else None
        return {"device_type": self.device.type, "device": self.device, "optimizer": user_opt,
                "optimizer_kwargs": self._optimizer_kwargs, "loss_fn": self._loss_fn,
                "max_grad_norm": self._max_grad_norm, "lr_scheduler": self._lr_scheduler_factory,
                "move_to": self.device, "loss_reduction": self._reduction, "padding_cut": self._padding}

    def _install_guard(self, plan: Plan, prepare_kwargs: dict[str, Any]) -> None:
        """Telemetry, leak detection and OOM recovery (a re-plan on the same profile, the same batch retried)."""
        escalate = step_down
        if self._profile is not None:  # calibration="ignore"/"clear": the escalation does not read it either
            escalate = PlanEscalator(self._profile, calibration_ratio=None if self._calibration == "use" else 1.0)
        replanner = PreparedReplanner(self._prepared, dict(prepare_kwargs), escalate)
        self.guard = RuntimeGuard(self._prepared.step, plan, run_dir=self._run_dir, replanner=replanner,
                                  transaction=self._transaction)

    # -- the training API ------------------------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        return self._user_model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        if self._sharded is not None:
            return self._sharded.optimizer
        self._require_prepared()
        return self._prepared.optimizer

    @property
    def engine(self) -> Any:
        """The offload plan's engine (a DeepSpeed engine or the FSDP2 module), or None."""
        return self._sharded.model if self._sharded is not None else None

    @property
    def lr_scheduler(self) -> Any:
        self._require_prepared()
        return self._prepared.step.lr_scheduler

    def _require_prepared(self) -> None:
        if self._sharded is not None:
            raise ValueError(f"this plan offloads the model states through {self._sharded.setting.engine}, whose "
                             "engine owns the forward, backward and optimizer step: train with step(batch), "
                             "checkpoint with save(dir)/load(dir), reach the engine as wrapped.engine")
        self._checks.require_wrapped()
        if self._prepared is None:
            raise ValueError("memopt.wrap planned nothing yet: call step(batch) once (it plans from that batch) "
                             "or pass sample= to memopt.wrap")

    @torch.enable_grad()  # a training step (its planning and autotune too) needs gradients inside a caller's no_grad
    def step(self, batch: Any) -> float:
        """One optimizer step over the global ``batch`` (a tensor, tuple, list or dict of tensors: see
        ``memopt.step.batch``); returns its mean loss. Refused after ``close()``, and for parameters that require grad
        but that no param group of ``wrapped.optimizer`` holds (``memopt.apply.step_checks``)."""
        check_batch(batch)
        self._checks.before_planning()
        whole = indivisible(batch)
        if whole and self.plan is not None and not self.plan.model.get("sample", {}).get("indivisible"):
            raise ValueError(f"{whole}, but the plan was made for a batch of "
                             f"{self.plan.global_batch} samples along dim 0: step batches shaped as the planned one, "
                             "or wrap again with sample=<this batch>")
        if self._prepared is None and self._sharded is None:
            self.plan = self._make_plan(batch)
            self._apply(self.plan)
        if self._shape_watch is None:
            self._shape_watch = watch_for(self._profile, self.plan, self._user_model)
        self._shape_watch.check(batch)
        if self._sharded is not None:
            self._started_training()
            loss = self._sharded.step(batch)
            self.steps_done += 1
            self.items_seen += count_loss_items(batch, causal=self._sharded._step.causal_lm)
            return loss
        if self._autotune_pending:
            self._run_autotune(batch)
        self._started_training()
        # lazy: keeps memopt.guard.attribution_hooks (and guard.attribution) out of import memopt
        from memopt.guard.attribution_hooks import record_wrapped_step

        self._checks.before_step(self._prepared.optimizer, self._prepared.step.master)
        try:
            with record_wrapped_step(self, batch):  # one step's bytes by module, into run_dir
                if self.guard is not None:
                    try:
                        loss = self.guard.step(batch)
                    finally:
                        self._follow_guard()
                else:
                    loss = self._prepared.step.step(batch)
        except SchedulerStepFailed:
            self._count_step(batch)  # the weights moved before the scheduler raised: the step was taken
            raise
        self.plan.notes.extend(filter(None, [self._padding.note()]))  # the padding verdict, once decided
        if self.steps_done == 0:
            progress.done(f"first step trained: {self.plan.strategy.label()}")
        self._count_step(batch)
        return loss

    def _follow_guard(self) -> None:
        """Take the plan and pieces the guard applies now, whatever its step did: a re-plan after an OOM replaces
        them (the old pieces are undone), also where recovery then gave up or was interrupted, so that ``save``,
        ``unwrap`` and ``optimizer`` read what trains (a re-plan of the micro-batch alone keeps the pieces)."""
        if self.guard.prepared is not None:
            self._prepared = self.guard.prepared
        if self.guard.plan is not None:
            self.plan = self.guard.plan

    def _count_step(self, batch: Any) -> None:
        self.steps_done += 1
        self.items_seen += count_loss_items(batch, causal=self._prepared.step.causal_lm)

    def _started_training(self) -> None:
        """The first training step starts now (after the plan and the autotune): ``startup_s`` is set once."""
        if self.startup_s is None:
            self.startup_s = time.perf_counter() - self._started

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """The plan's autocast (and attention kernel) for a hand-written forward pass."""
        self._require_prepared()
        strategy = self.plan.strategy
        with sdpa_restricted(strategy.attention), forward_context(strategy.precision, self.device.type):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` for a hand-written loop; under an fp16 plan the gradients it leaves are unscaled (the
        true ones), so clipping or logging them before ``optimizer_step`` needs no ``unscale_``."""
        self._require_prepared()
        self._prepared.step.backward_unscaled(loss)

    def optimizer_step(self) -> None:
        """Clip, step (skipped, as GradScaler skips it, when an fp16 backward overflowed), copy master weights back
        (bf16_master), clear gradients. Checked as ``step`` is, and counted in ``steps_done`` as it is; ``items_seen``
        counts only the batches ``step`` was given, as the hand-written loop's batches are never seen here."""
        self._require_prepared()
        self._checks.before_step(self._prepared.optimizer, self._prepared.step.master, stacklevel=3)
        step = self._prepared.step
        before = step.steps_done
        try:
            step.optimizer_step()
        finally:
            # counted once the weights moved, also where the scheduler raised after them (SchedulerStepFailed)
            self.steps_done += step.steps_done - before

    def progress(self) -> str:
        """A short memory line for a progress bar (allocated / budget, the prediction beside it)."""
        return self.guard.progress() if self.guard is not None else self.describe()

    def close(self) -> None:
        """End the run: flush telemetry and store the measured peaks as a calibration for later plans; a one-GPU
        offload engine's process group, started by memopt, is destroyed. ``step`` refuses afterwards; ``save``,
        ``unwrap`` and the model stay usable (save first to keep the training state of an offload plan)."""
        self._checks.closed = True
        if self.guard is not None:
            self.guard.close()
        if self._sharded is not None:
            self._sharded.close()

    def unwrap(self) -> nn.Module:
        """Remove every technique and return the user's module (weights keep their trained values)."""
        if self._sharded is not None:
            raise ValueError(f"an offload plan's {self._sharded.setting.engine} engine holds the parameters (sharded "
                             "and on the host): write them with save(dir) and load that checkpoint where you need "
                             "them, or keep training through step(batch)")
        self.close()
        if self._prepared is not None:
            self._prepared.undo()
            self._prepared = None
            self._checks.unwrapped = True
        self._user_model.__dict__.pop(WRAPPED_BY, None)
        return self._user_model

    def describe(self) -> str:
        if self.plan is None:
            return "memopt: not planned yet"
        p = self.plan
        return (f"memopt plan: {p.strategy.label()} | predicted {format_bytes(p.total_bytes)} of "
                f"{format_bytes(p.budget_bytes)}, {p.step_time_s:.3f} s/step")
