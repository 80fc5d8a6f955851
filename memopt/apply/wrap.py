"""``memopt.wrap(model, budget="40GB")``: plan (or take a saved plan), apply it for real, train under it.

    >>> wrapped = memopt.wrap(model, budget="40GB", sample={"batch_size": 8, "seq_len": 4096},
    ...                       optimizer="adamw", lr=1e-4)
    >>> for batch in loader:                 # the global batch; memopt splits it into the plan's micro-batches
    ...     loss = wrapped.step(batch)

Any batch structure works (a tensor, an ``(x, y)`` tuple, a dict, nested), with the loss from the model's
``.loss``, ``loss_fn(output, batch)`` or ``training_step(model, batch)``: ``memopt.step.batch``. A plan that
offloads the model states (nothing fits on the GPU alone) is applied in this process by its engine
(``memopt.distributed.wrapped``, a one-process group started for it).

The pieces stay usable for a hand-written loop (``wrapped.model``, ``wrapped.optimizer``,
``wrapped.autocast()``, ``wrapped.backward(loss)``, ``wrapped.optimizer_step()``), e.g. with accelerate.
``wrapped.unwrap()`` removes every technique and returns the user's module (its state_dict loads into
an unwrapped model unchanged). A Hugging Face ``Trainer`` can be wrapped too: its arguments are set
from the plan (see ``memopt.integrations.hf_trainer``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memopt.apply.step_checks import refuse_inference_mode
from memopt.apply.wrap_checks import is_trainer, refuse_plan_overrides, refuse_trainer_ignored
from memopt.apply.wrapped import Wrapped
from memopt.errors import InputError, as_input_errors
from memopt.guard.transaction import StepTransaction
from memopt.plan.context import resolve_hardware
from memopt.plan.schema import Plan
from memopt.plan.wrap_arguments import check_wrap_args
from memopt.step.batch import as_loss
from memopt.step.loss_reduction import LossReduction, starting_mode
from memopt.techniques.optimizer_instance import (
    has_unpassed_scheduler,
    is_optimizer,
    is_scheduler,
    optimizer_factory,
    scheduler_factory,
    scheduler_refusal,
)
from memopt.units import parse_budget

if TYPE_CHECKING:
    from transformers import Trainer

    from memopt.distributed.wrapped import ShardedWrapped

__all__ = ["wrap"]


def wrap(target: Any, budget: str | int | float | None = None, *, sample: Any = None,
         plan: Plan | str | os.PathLike[str] | None = None, optimizer: str | Callable[..., Any] | None = "adamw",
         lr: float | None = None, weight_decay: float | None = None, betas: tuple[float, float] | None = None,
         optimizer_kwargs: dict[str, Any] | None = None,
         loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
         training_step: Callable[[nn.Module, Any], torch.Tensor] | None = None,
         lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None, max_grad_norm: float | None = None,
         hardware: Any = None, policy: Any = None, fidelity: Any = None, pins: dict[str, Any] | None = None,
         forbid: dict[str, Any] | None = None, device: Any = None, enforce_budget: bool = True,
         use_cache: bool = True, guard: bool = True, run_dir: str | os.PathLike[str] | None = None,
         autotune: bool | None = None,
         checkpoint: str | os.PathLike[str] | list[str | os.PathLike[str]] | None = None,
         transaction: str = "auto", calibration: str = "use",
         allow_plan_mismatch: bool = False, loss_reduction: str = "auto") -> Wrapped | ShardedWrapped | Trainer:
    """Plan (or take ``plan``) and apply it to ``target`` (an ``nn.Module`` or a Hugging Face ``Trainer``).

    ``sample`` is optional: without it the plan is made when the first batch reaches ``step``. ``optimizer`` is a
    name ('adamw' lets memopt choose among AdamW variants the policy allows, 'sgd', ...) with
    ``lr``/``weight_decay``/``betas``/``optimizer_kwargs``, or a callable taking the parameters. The loss is made by
    the batch contract of ``memopt.step.batch``: ``training_step(model, batch) -> loss`` when given (a
    Lightning-style step: you call the model), else the model called on the batch (a dict's keys that ``forward``
    takes, a tensor, or a tuple/list ``(inputs..., target)``) and ``loss_fn(output, batch)`` or the output's
    ``.loss``. A batch is any nesting of tensors, tuples, lists and dicts, samples along dim 0. ``loss_reduction``
    says how your loss reduces over the samples, so micro-batches accumulate the whole batch's gradient: "mean",
    "sum", or "auto" (measured on the first batch that is split; ``memopt.step.loss_reduction``). On a GPU the
    allocator is capped at the budget minus the memory held outside it (``enforce_budget``). ``hardware``: not
    given, the local GPU, or ``memopt.hardware.DEFAULT_HARDWARE`` (h100_80gb) where none is visible (the plan's
    notes say so), as for ``memopt.plan`` and ``memopt.profile``; ``'auto'``: the local GPU only (an error
    without one). ``guard`` adds per-step memory telemetry (written
    to ``run_dir``), leak detection and OOM recovery (re-plan, retry the same batch; see ``memopt.guard``);
    ``transaction`` says when the guard copies parameters and optimizer states before an optimizer step, to undo an
    OOM inside it: "auto" (when the step is at risk), "always" or "never". ``autotune`` (default: on a GPU when wrap
    makes the plan) measures the planner's choice against the fastest plan of each checkpointing mode on the first
    batch and keeps the fastest (``memopt.apply.autotune``); a saved ``plan=`` is applied unchanged.

    ``checkpoint``: safetensors file(s) holding the weights of a model built without them -- ``target`` a model
    spec (a shipped name such as ``"llama3_8b"``, a ``ModelSpec`` or its dict) or a module on the meta device.
    The plan is made first, and the weights then load straight onto the GPU in the plan's precision, layer by
    layer; with quantized weights each target linear is quantized as it loads (``load_quantized``), so the
    full-precision model never sits in GPU memory.

    Every argument is checked first, with the checks and messages of ``memopt.plan`` (``memopt.plan.checks``):
    bad input raises one ``ValueError`` naming each problem and what would work. ``calibration``: "use" the
    stored measured/predicted ratios of clean earlier runs, "ignore" them, or "clear" them first. A saved
    ``plan=`` made for another model (its fingerprint) or another global batch is refused unless
    ``allow_plan_mismatch=True``. Returns a ``Wrapped`` (one GPU), a ``ShardedWrapped`` (a sharded plan under
    torchrun) or the ``Trainer`` it was given, set up from the plan.
    """
    started = time.perf_counter()  # the time to the first step counts from here (Wrapped.startup_s)
    refuse_inference_mode("memopt.wrap")  # under no_grad it plans (with gradients on) and applies as anywhere
    if is_trainer(target):
        refuse_trainer_ignored({name: value for name, value, default in (
            ("optimizer", optimizer, "adamw"), ("lr", lr, None), ("weight_decay", weight_decay, None),
            ("betas", betas, None), ("optimizer_kwargs", optimizer_kwargs or None, None), ("loss_fn", loss_fn, None),
            ("training_step", training_step, None), ("lr_scheduler", lr_scheduler, None),
            ("max_grad_norm", max_grad_norm, None), ("loss_reduction", loss_reduction, "auto"),
            ("run_dir", run_dir, None), ("device", device, None), ("checkpoint", checkpoint, None),
            ("autotune", autotune, None), ("calibration", calibration, "use")) if value != default})
    kwargs = dict(optimizer_kwargs or {})
    for name, value in (("lr", lr), ("weight_decay", weight_decay), ("betas", betas)):
        if value is not None:
            kwargs[name] = value
    StepTransaction.check_mode(transaction)
    loss_fn = as_loss(loss_fn, training_step)
    optimizer, lr_scheduler = _from_instances(target, optimizer, lr_scheduler, kwargs)
    loaded = Plan.load(plan) if isinstance(plan, (str, os.PathLike)) else plan
    with as_input_errors():  # the arguments against each other and against a saved plan: each refusal is the user's
        check_wrap_args(target, budget=budget, sample=sample, plan=loaded, optimizer=optimizer,
                        optimizer_kwargs=kwargs, hardware=hardware, pins=pins, transaction=transaction,
                        calibration=calibration, allow_plan_mismatch=allow_plan_mismatch,
                        loss_reduction=loss_reduction, max_grad_norm=max_grad_norm, device=device, run_dir=run_dir,
                        lr_scheduler=lr_scheduler)
        if loaded is not None:
            refuse_plan_overrides(loaded, {name: value for name, value in (
                ("budget", budget), ("optimizer", None if optimizer == "adamw" or callable(optimizer) else optimizer),
                ("policy", policy), ("fidelity", fidelity), ("pins", pins), ("forbid", forbid)) if value is not None})
    if is_trainer(target):
        # lazy: keeps memopt.integrations (Trainer support) out of import memopt
        from memopt.integrations.hf_trainer import wrap_trainer

        return wrap_trainer(target, budget=budget, sample=sample, plan=loaded, hardware=hardware, policy=policy,
                            fidelity=fidelity, pins=pins, forbid=forbid, enforce_budget=enforce_budget,
                            use_cache=use_cache, recover=guard, transaction=transaction)
    if checkpoint is not None and not isinstance(target, nn.Module):
        # lazy: keeps memopt.techniques.quantized_load out of import memopt
        from memopt.techniques.quantized_load import model_skeleton

        target = model_skeleton(target)
    if not isinstance(target, nn.Module):
        raise InputError([f"memopt.wrap takes a torch.nn.Module or a transformers Trainer (or, with checkpoint=, a "
                          f"model spec), got {type(target).__name__}"])
    if loaded is None and budget is None:
        raise InputError(["memopt.wrap needs budget= (e.g. '40GB', '40GiB', '80%') or a saved plan="])
    # lazy: keeps memopt.distributed.wrapped (offload/sharded engines) out of import memopt
    from memopt.distributed.wrapped import ShardedWrapped, is_sharded_plan

    if is_sharded_plan(loaded):  # FSDP2 / DeepSpeed / DDP in each process of a torchrun job
        return ShardedWrapped(target, loaded, optimizer_kwargs=kwargs, loss_fn=loss_fn, device=device,
                              max_grad_norm=max_grad_norm, lr_scheduler=lr_scheduler, checkpoint=checkpoint,
                              loss_reduction=LossReduction(starting_mode(target, loss_fn, loss_reduction)))
    if budget is not None and loaded is None:
        hw = resolve_hardware(hardware) if hardware != "auto" or torch.cuda.is_available() else None
        parse_budget(budget, device_total_bytes=hw.memory_bytes if hw is not None else None)  # fail early
    return Wrapped(target, started=started, budget=budget, sample=sample, plan=loaded, optimizer=optimizer,
                   optimizer_kwargs=kwargs, loss_fn=loss_fn, lr_scheduler=lr_scheduler, max_grad_norm=max_grad_norm,
                   hardware=hardware, policy=policy, fidelity=fidelity, pins=pins, forbid=forbid, device=device,
                   enforce_budget=enforce_budget, use_cache=use_cache, guard=guard, run_dir=run_dir,
                   autotune=autotune, checkpoint=checkpoint, transaction=transaction, calibration=calibration,
                   loss_reduction=loss_reduction)


def _from_instances(target: Any, optimizer: Any, lr_scheduler: Any, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """An optimizer (and a scheduler on it) the user built before wrapping, as the recipes memopt builds from
    (``memopt.techniques.optimizer_instance``)."""
    if is_scheduler(lr_scheduler) and not is_optimizer(optimizer):
        raise ValueError("lr_scheduler= is a scheduler built on an optimizer memopt does not have: pass that "
                         "optimizer too (optimizer=opt), or a callable optimizer -> scheduler")
    if kwargs and (is_optimizer(optimizer) or (callable(optimizer) and not isinstance(optimizer, str))):
        raise ValueError(f"{', '.join(sorted(kwargs))} given beside an optimizer you build yourself, which would "
                         "ignore it: set it where the optimizer is built")
    if not is_optimizer(optimizer):
        return optimizer, lr_scheduler
    if not isinstance(target, nn.Module):
        raise ValueError("optimizer= an optimizer instance goes with a model: a Trainer builds its own (pass it to "
                         "the Trainer as optimizers=(opt, scheduler))")
    if lr_scheduler is None and has_unpassed_scheduler(optimizer):
        # memopt trains with an optimizer of its own, built from this one: a scheduler the user steps on this one
        # would change nothing that trains
        raise InputError(["the optimizer passed to memopt.wrap has a learning-rate scheduler built on it, which "
                          "memopt would not step (it trains with its own optimizer, built from yours): pass "
                          "lr_scheduler=<your scheduler> to memopt.wrap, which steps it after each optimizer step, "
                          "and stop calling its step() yourself"])
    if is_scheduler(lr_scheduler):
        refusal = scheduler_refusal(lr_scheduler, "lr_scheduler=")
        if refusal is not None:
            raise InputError([refusal])
        lr_scheduler = scheduler_factory(lr_scheduler, optimizer)
    return optimizer_factory(optimizer, target), lr_scheduler
