"""``memopt.wrap(trainer, budget=...)``: a Hugging Face ``Trainer`` script, planned by memopt.

The plan becomes the Trainer's own arguments (``per_device_train_batch_size``,
``gradient_accumulation_steps``, ``bf16``/``fp16``, ``optim``), the precision also reaches the Trainer's
accelerator (built before ``wrap``: ``memopt.integrations.trainer_setup``), memopt's own activation checkpointing
is applied to the model's blocks (any number of them, or selectively; the Trainer's ``gradient_checkpointing``
stays off), and a callback sets the budget cap when training begins. The search is restricted to what runs
inside the Trainer's step: no activation offload, no chunked loss, AdamW variants the Trainer knows.

The allocator's segment mode can change only before CUDA holds memory. A model the script already moved to the
GPU fixes it: memopt then plans for the mode in force (a warning says so) rather than predicting for one that
cannot be set.

The global batch is the Trainer's per-device batch x gradient accumulation (x processes), as the user
configured it; memopt keeps it and chooses how to split it, and each optimizer step trains on the script's rows,
with ``dataloader_drop_last`` too (``memopt.integrations.trainer_data``). The sample it plans that batch on is read
from the Trainer's own data: ``memopt.integrations.trainer_sample``. A ``training_step`` of the script's own is run as
the script wrote it, on the script's per-device batch and accumulation (memopt cannot weight what it backpropagates),
so the plan fits that micro-batch. Checkpoints keep describing the script's batch:
``memopt.integrations.trainer_checkpoint``.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

from memopt import progress
from memopt.guard.attribution_hooks import TrainerStepAttribution
from memopt.guard.transaction import StepTransaction
from memopt.integrations.trainer_checkpoint import ScriptBatch, save_as_script
from memopt.integrations.trainer_data import keep_script_rows
from memopt.integrations.trainer_loss import script_step, trainer_loss
from memopt.integrations.trainer_optim import TRAINER_OPTIM, kept_optimizer, script_optimizer
from memopt.integrations.trainer_recovery import MicroBatchedTrainingStep, trainer_escalator
from memopt.integrations.trainer_sample import sample_from_trainer
from memopt.integrations.trainer_setup import TrainerCheckpointing, fit_evaluation, set_trainer_precision
from memopt.plan.context import resolve_hardware, resolve_policy
from memopt.plan.planner import make_plan
from memopt.plan.schema import Plan
from memopt.profile.api import profile_model
from memopt.step.batch_samples import indivisible
from memopt.step.batch_tree import is_batch, tensors
from memopt.step.hard_cap import (
    allocator_mode_in_force,
    cap_to_plan,
    set_expandable_segments,
    warn_allocator_mode_fixed,
)
from memopt.step.side_effects import preserved_random_state
from memopt.techniques.micro_batching import micro_batch_refusal
from memopt.techniques.optimizers import USER
from memopt.units import format_bytes

__all__ = ["TRAINER_OPTIM", "TRAINER_PRECISIONS", "MemoptCallback", "trainer_arguments", "wrap_trainer"]

#: the Trainer's arguments that shape its batches
_BATCH_ARGUMENTS = ("per_device_train_batch_size", "gradient_accumulation_steps")

#: the precisions a Trainer's loop runs: fp32 weights, with or without autocast
TRAINER_PRECISIONS = ("fp32", "bf16_autocast", "fp16_autocast")


def trainer_arguments(plan: Plan, *, micro_batches_inside: bool = False, world_size: int = 1,
                      memopt_checkpointing: bool = False) -> dict[str, Any]:
    """The TrainingArguments fields that carry out ``plan``. ``micro_batches_inside``: the Trainer gets the whole
    global batch of its process in one accumulation step, and memopt's ``training_step`` splits it into the
    plan's micro-batches (what OOM recovery needs, see ``memopt.integrations.trainer_recovery``).
    ``memopt_checkpointing``: memopt checkpoints the blocks itself (``TrainerCheckpointing``, any setting), so the
    Trainer's own ``gradient_checkpointing`` stays off; otherwise the plan must checkpoint every block or none."""
    s = plan.strategy
    if s.optimizer not in TRAINER_OPTIM and s.optimizer != USER:
        raise ValueError(f"the Trainer has no optimizer for memopt's {s.optimizer!r}; plan with one of "
                         f"{', '.join(TRAINER_OPTIM)} (pin optimizer=...)")
    if s.activation_offload or s.chunked_ce or s.attention != "auto" or s.precision not in TRAINER_PRECISIONS:
        raise ValueError(f"the plan uses techniques a Trainer cannot express ({s.label()}); plan with "
                         "memopt.wrap(trainer, ...) so the search is restricted to what the Trainer supports")
    partial = s.checkpointing.mode == "selective" or (s.checkpointing.mode == "full" and s.checkpointing.num_blocks)
    if partial and not memopt_checkpointing:
        raise ValueError("the Trainer's gradient_checkpointing checkpoints every block or none and this plan "
                         "checkpoints some blocks only: apply it with memopt.wrap(trainer, plan=...), which "
                         "checkpoints them itself")
    hf_checkpointing = s.checkpointing.mode == "full" and not memopt_checkpointing
    per_process = max(1, plan.global_batch // max(1, world_size))
    return {
        "per_device_train_batch_size": per_process if micro_batches_inside else s.micro_batch_size,
        "gradient_accumulation_steps": 1 if micro_batches_inside else s.grad_accum_steps,
        "bf16": s.precision == "bf16_autocast",
        "fp16": s.precision == "fp16_autocast",
        "gradient_checkpointing": hf_checkpointing,
        "gradient_checkpointing_kwargs": {"use_reentrant": False} if hf_checkpointing else None,
        # the script's own optimizer (memopt's "user"): the Trainer builds it as the script asked
        **({} if s.optimizer == USER else {"optim": TRAINER_OPTIM[s.optimizer]}),
    }


class MemoptCallback:
    """Applies the allocator mode and the budget cap when training begins; records the measured peak."""

    def __init__(self, plan: Plan, enforce_budget: bool = True) -> None:
        self.plan = plan
        self.enforce_budget = enforce_budget
        self.measured_peak_allocated_bytes = 0
        self.measured_peak_reserved_bytes = 0
        self.cap_fraction: float | None = None  # of the device's memory, once training began on a GPU

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        return control

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if torch.cuda.is_available() and self.enforce_budget:
            index = getattr(getattr(args, "device", None), "index", None)  # the Trainer's GPU (torchrun's rank)
            device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
            self.cap_fraction = cap_to_plan(self.plan.budget_bytes, int(self.plan.prediction.get("runtime_bytes", 0)),
                                            device)
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if torch.cuda.is_available():
            self.measured_peak_allocated_bytes = max(self.measured_peak_allocated_bytes,
                                                     torch.cuda.max_memory_allocated())
            self.measured_peak_reserved_bytes = max(self.measured_peak_reserved_bytes, torch.cuda.max_memory_reserved())
        return control

    def __getattr__(self, name: str) -> Any:  # every other TrainerCallback event: nothing to do
        if name.startswith("on_"):
            return lambda args, state, control, **kwargs: control
        raise AttributeError(name)


# why the Trainer path plans neither adapters nor a quantized base: the Trainer built its model, and its optimizer
# from that model's parameters, before memopt sees it
_NO_EXTRAS = ("under a Trainer memopt adds no adapters and quantizes nothing (the Trainer trains the model it was "
              "given); build the peft model first (peft.get_peft_model, on a model loaded quantized for QLoRA), give "
              "it to the Trainer and wrap that Trainer")


def _script_precision(args: Any) -> str | None:
    """The autocast precision the Trainer's arguments ask for (``bf16=True`` / ``fp16=True``; TRL's ``SFTConfig``
    asks for bf16 by default), or None (fp32: the plan may still choose bf16 under the default fidelity)."""
    if getattr(args, "bf16", False):
        return "bf16_autocast"
    if getattr(args, "fp16", False):
        return "fp16_autocast"
    return None


def _plan_for_trainer(trainer: Any, *, budget: Any, sample: Any, plan: Plan | None, hardware: Any, policy: Any,
                      fidelity: Any, pins: dict[str, Any] | None, forbid: dict[str, Any] | None, use_cache: bool,
                      recover: bool) -> tuple[Plan, Any]:
    """The plan (``plan`` when given) and, with ``recover``, the profile its escalations re-plan on."""
    profile = None
    if plan is None:
        if budget is None:
            raise ValueError("memopt.wrap(trainer) needs budget= (e.g. '24GB') or a saved plan=")
        pinned = (pins or {}).get("precision")
        if pinned is not None and pinned not in TRAINER_PRECISIONS:
            raise ValueError(f"pin precision={pinned!r} cannot run under a Trainer, whose loop trains fp32 weights "
                             f"(autocast or not): pin one of {', '.join(TRAINER_PRECISIONS)}, or wrap the model "
                             "itself with memopt.wrap(model, ...)")
        # what the Trainer's own step cannot run: weights in bf16 (its optimizer steps the parameters themselves)
        restricted: dict[str, list[Any]] = {"activation_offload": [True], "precision": ["bf16_master", "bf16_pure"]}
        for key, values in (forbid or {}).items():
            restricted.setdefault(key, [])
            restricted[key] = list(restricted[key]) + list(values if isinstance(values, (list, tuple)) else [values])
        asked_extras = {k: v for k, v in (pins or {}).items() if k in ("adapter_rank", "quant_bits") and v}
        if asked_extras:
            raise ValueError(f"pins {', '.join(f'{k}={v!r}' for k, v in asked_extras.items())} cannot run under a "
                             f"Trainer: {_NO_EXTRAS}")
        # a pin of 0 keeps the ladder at full fine-tuning: the Trainer trains the model it was given
        trainer_pins = {"chunked_ce": 0, "attention": "auto", "adapter_rank": 0, "quant_bits": 0, **(pins or {})}
        in_force = allocator_mode_in_force()
        if in_force is not None and "expandable_segments" not in trainer_pins:
            trainer_pins["expandable_segments"] = in_force  # CUDA holds memory already: plan for the mode it has
            warn_allocator_mode_fixed(in_force)
        args = trainer.args
        resolved = resolve_policy(policy, fidelity=fidelity)
        user_opt = None
        if "optimizer" not in trainer_pins:  # the script chose its update: the plan keeps it
            optimizer_pins, user_opt = script_optimizer(trainer, resolved)
            trainer_pins.update(optimizer_pins)
        asked = _script_precision(args)
        if asked is not None and "precision" not in trainer_pins:
            if resolved.allows("precision", asked):
                trainer_pins["precision"] = asked  # the script chose its numerics: the plan keeps them
            else:
                warnings.warn(f"the Trainer's arguments ask for {asked}, which the plan's fidelity does not allow: "
                              "the plan chooses the precision; fidelity='mixed' keeps the script's", stacklevel=3)
        if ("micro_batch_size" not in trainer_pins and args.gradient_accumulation_steps > 1
                and micro_batch_refusal(trainer.model) is not None):
            # the script already splits its batch, and its BatchNorm statistics come from its own micro-batch: that
            # is the training to reproduce (memopt.techniques.micro_batching refuses any other split)
            trainer_pins["micro_batch_size"] = args.per_device_train_batch_size
        own_step = script_step(trainer)
        if own_step is not None:
            per_device = args.per_device_train_batch_size
            if trainer_pins.get("micro_batch_size", per_device) != per_device:
                raise ValueError(f"pin micro_batch_size={trainer_pins['micro_batch_size']} cannot apply: the Trainer "
                                 f"runs the script's {own_step}, which memopt cannot split, on the script's "
                                 f"per_device_train_batch_size={per_device}; pin that or drop the pin")
            trainer_pins["micro_batch_size"] = per_device  # the step the script wrote runs on the rows it expects
        step = trainer_loss(trainer)  # a subclass's compute_loss, a compute_loss_func, label smoothing
        sample = sample_from_trainer(trainer, sample, own_loss=step is not None)
        whole = indivisible(sample) if is_batch(sample) and tensors(sample) else None
        if whole:  # the Trainer's batch size counts rows: planned as one sample, its split would be another batch
            raise ValueError(f"{whole}: a Trainer's batch must hold its rows along dim 0 for memopt "
                             "to keep the Trainer's batch size; collate rows batch-first")
        if recover:  # the same profile serves the plan and, after an OOM, its escalation
            hardware = resolve_hardware(hardware)
            profile = profile_model(trainer.model, sample, hardware=hardware, use_cache=use_cache,
                                    training_step=step, optimizer=user_opt)
        plan = make_plan(trainer.model, sample, budget=budget, hardware=hardware, policy=policy, fidelity=fidelity,
                         pins=trainer_pins, forbid=restricted, use_cache=use_cache, profile=profile,
                         training_step=step, optimizer=user_opt)
        if resolved.allow & {"adapters", "quantized_weights"}:
            plan.notes.append(f"adapters and quantized weights refused: {_NO_EXTRAS}")
        if user_opt is not None:
            plan.notes.append(f"the script's optimizer ({kept_optimizer(trainer)}) is kept: the plan counts the states "
                              "it traced, and the Trainer builds it as the script asked")
    return plan, profile


def wrap_trainer(trainer: Any, *, budget: Any, sample: Any = None, plan: Plan | None = None, hardware: Any = "auto",
                 policy: Any = None, fidelity: Any = None, pins: dict[str, Any] | None = None,
                 forbid: dict[str, Any] | None = None, enforce_budget: bool = True, use_cache: bool = True,
                 recover: bool = True, transaction: str = "auto") -> Any:
    """Plan for ``trainer``'s model and global batch, set its arguments, install the callback; returns it.

    ``recover``: the plan's micro-batches run inside the Trainer's ``training_step`` (one accumulation step over
    the process's global batch), so that an out-of-memory error in forward or backward is recovered: the plan is
    escalated and the same batch retried (``memopt.integrations.trainer_recovery``); and the optimizer step is
    all-or-nothing under an OOM and retried (``memopt.integrations.trainer_optimizer_step``; ``transaction``:
    when parameters and states are copied before the step, "auto", "always" or "never").
    ``trainer.memopt_recovery`` holds the report."""
    StepTransaction.check_mode(transaction)
    if getattr(trainer, "memopt_plan", None) is not None:
        raise ValueError("this Trainer is already wrapped by memopt.wrap (trainer.memopt_plan): train it as it is, "
                         "or build a new Trainer to plan it again")
    if plan is None:
        progress.start(f"profiling {type(trainer.model).__name__} for the Trainer (fake-tensor traces of the "
                       "training step)")
    with preserved_random_state():  # planning draws random numbers; the script's draws stay as without memopt
        plan, profile = _plan_for_trainer(trainer, budget=budget, sample=sample, plan=plan, hardware=hardware,
                                          policy=policy, fidelity=fidelity, pins=pins, forbid=forbid,
                                          use_cache=use_cache, recover=recover)
    extras = [k for k in ("adapters", "quantization") if plan.strategy.extra(k) is not None]
    if extras:
        raise ValueError(f"the plan [{plan.strategy.label()}] uses {' and '.join(extras)}: {_NO_EXTRAS}")
    if not plan.fits:
        progress.done("no Trainer configuration fits the budget")
        raise ValueError(f"no Trainer configuration fits the budget: "
                         f"{plan.infeasible['message'] if plan.infeasible else ''}")
    own_step = script_step(trainer)
    if own_step is not None and plan.strategy.micro_batch_size != trainer.args.per_device_train_batch_size:
        raise ValueError(f"the plan's micro-batch of {plan.strategy.micro_batch_size} cannot apply: the Trainer runs "
                         f"the script's {own_step}, which memopt cannot split, on the script's "
                         f"per_device_train_batch_size={trainer.args.per_device_train_batch_size}")
    set_expandable_segments(plan.strategy.expandable_segments)
    world = max(1, getattr(trainer.args, "world_size", 1))
    script_batch = getattr(trainer, "_train_batch_size", None) or trainer.args.train_batch_size
    inside = recover and own_step is None
    script = ScriptBatch(trainer)
    for key, value in trainer_arguments(plan, micro_batches_inside=inside, world_size=world,
                                        memopt_checkpointing=True).items():
        if value is None and key == "gradient_checkpointing_kwargs":
            continue
        if own_step is not None and key in _BATCH_ARGUMENTS:
            continue  # the script's step runs on the script's batches, accumulated by the Trainer as the script set
        if key in ("bf16", "fp16"):
            continue  # set with the accelerator's precision below
        setattr(trainer.args, key, value)
    if hasattr(trainer, "_train_batch_size"):  # the Trainer copies the batch size at init; its loader reads the copy
        trainer._train_batch_size = trainer.args.train_batch_size
    if own_step is None:  # memopt's batch arguments run; checkpoints keep describing the script's
        save_as_script(trainer, script)
    keep_script_rows(trainer, script_batch)  # what dataloader_drop_last drops stays what the script's loader drops
    set_trainer_precision(trainer, plan.strategy.precision)
    for note in fit_evaluation(trainer, plan.strategy.micro_batch_size):
        progress.report(note)
        plan.notes.append(note)
    checkpointing = TrainerCheckpointing(trainer.model)
    checkpointing.apply(plan.strategy.checkpointing)
    trainer.memopt_checkpointing = checkpointing
    callback = MemoptCallback(plan, enforce_budget)
    trainer.add_callback(callback)
    attribution = TrainerStepAttribution(plan)  # the first step by module: <output_dir>/memopt
    trainer.add_callback(attribution)
    _close_when_train_raises(trainer, attribution)
    trainer.memopt_plan = plan
    trainer.memopt_callback = callback
    progress.done(f"planned: {plan.strategy.label()} (predicted {format_bytes(plan.total_bytes)} of "
                  f"{format_bytes(plan.budget_bytes)}, {plan.step_time_s:.3f} s/step); the Trainer is set up with it")
    trainer.memopt_recovery = None
    if own_step is not None:
        plan.notes.append(f"the Trainer runs the script's {own_step}: memopt keeps the script's per-device batch and "
                          "gradient accumulation (the step cannot be split into other micro-batches, nor retried "
                          "after an out-of-memory error)")
    elif recover:
        trainer.memopt_recovery = MicroBatchedTrainingStep(trainer, plan, escalate=trainer_escalator(profile),
                                                           transaction=transaction).install()
    return trainer


def _close_when_train_raises(trainer: Any, attribution: Any) -> None:
    """``trainer.train`` that ends the step's recording when the loop raises (an out-of-memory error the recovery
    gave up on, a user's error): the Trainer runs no callback then, and the recorder would stay entered."""
    train = trainer.train

    @functools.wraps(train)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return train(*args, **kwargs)
        except BaseException as exc:
            attribution.close(exc)
            raise

    trainer.train = guarded

