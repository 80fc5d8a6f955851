"""The checks of ``memopt.wrap``'s own arguments, before it plans or touches the model: the same checks, and
messages, as ``memopt.plan`` and ``python -m memopt.plan`` where the arguments are the same
(``memopt.plan.checks``), and the device it trains on."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from memopt.errors import raise_problems
from memopt.plan.calibrate import CALIBRATION_MODES
from memopt.plan.checks import (
    check_budget,
    check_global_batch_pins,
    check_hardware,
    check_hyperparameters,
    check_optimizer,
    check_plan_matches,
    check_positive,
    closest,
)
from memopt.step.batch import EMPTY_BATCH
from memopt.step.batch_samples import batch_size
from memopt.step.batch_tree import is_batch, tensors
from memopt.step.loss_reduction import REDUCTIONS

__all__ = ["check_device", "check_wrap_args"]


def check_device(device: Any, problems: list[str]) -> None:
    """A device memopt trains on: a CUDA GPU that is visible, or the CPU."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        problems.append(f"device={device!r} is not a torch device ({str(exc).splitlines()[0]}): use 'cuda', "
                        "'cuda:0' or 'cpu'")
        return
    if dev.type not in ("cuda", "cpu"):
        problems.append(f"device={device!r}: memopt trains on a CUDA GPU or the CPU ('cuda', 'cuda:0', 'cpu')")
    elif dev.type == "cuda" and not torch.cuda.is_available():
        problems.append(f"device={device!r}, but no CUDA GPU is visible: use device='cpu' (hardware=<a GPU name> "
                        "plans for that GPU)")
    elif dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        problems.append(f"device={device!r}, but only {torch.cuda.device_count()} GPU(s) are visible")


def check_wrap_args(target: Any, *, budget: Any, sample: Any, plan: Any, optimizer: Any,
                    optimizer_kwargs: Mapping[str, Any], hardware: Any, pins: Any, transaction: Any,
                    calibration: Any = "use", allow_plan_mismatch: bool = False,
                    loss_reduction: Any = "auto", max_grad_norm: Any = None, device: Any = None,
                    run_dir: Any = None, lr_scheduler: Any = None) -> None:
    """Everything ``memopt.wrap`` can check before it plans or touches the model; one ``InputError`` listing each
    problem (the same checks, and messages, as ``memopt.plan`` and ``python -m memopt.plan``)."""
    problems: list[str] = []
    hw = None
    if plan is None and budget is not None:
        if hardware not in (None, "auto") or torch.cuda.is_available():
            hw = check_hardware(hardware, problems)
        check_budget(budget, problems, device_total_bytes=hw.memory_bytes if hw is not None else None)
    check_optimizer(optimizer, problems)
    check_hyperparameters(optimizer_kwargs, problems, optimizer=optimizer)
    if max_grad_norm is not None:
        check_positive("max_grad_norm", max_grad_norm, problems, example="1.0")
    if lr_scheduler is not None and not callable(lr_scheduler):
        problems.append(f"lr_scheduler={lr_scheduler!r} is not callable: pass a callable optimizer -> scheduler, e.g. "
                        "lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, f)")
    if sample is not None and not isinstance(sample, Mapping | str) and is_batch(sample) and tensors(sample) \
            and batch_size(sample) == 0:
        problems.append(f"sample: {EMPTY_BATCH}")
    if device is not None:
        check_device(device, problems)
    if run_dir is not None and os.path.exists(run_dir) and not os.path.isdir(run_dir):
        problems.append(f"run_dir={str(run_dir)!r} is a file: give a folder for the step telemetry (it is created "
                        "if missing)")
    if pins is not None and not isinstance(pins, Mapping):
        problems.append(f"pins must be a dict such as {{'micro_batch_size': 2}}, got {type(pins).__name__}")
    elif isinstance(sample, Mapping):
        check_global_batch_pins(pins, sample.get("batch_size"), problems, batch_key="sample batch_size")
    if transaction not in ("auto", "always", "never"):
        problems.append(f"transaction={transaction!r}: use one of auto, always, never")
    if calibration not in CALIBRATION_MODES:
        problems.append(f"calibration={calibration!r} is not one of {', '.join(CALIBRATION_MODES)}"
                        f"{closest(calibration, CALIBRATION_MODES)}")
    if loss_reduction not in REDUCTIONS:
        problems.append(f"loss_reduction={loss_reduction!r}: use 'mean' (a loss averaged over samples or tokens), "
                        "'sum' (summed over them) or 'auto' (measured on the first batch)")
    raise_problems(problems, "arguments")
    check_plan_matches(plan, target, sample, allow_mismatch=allow_plan_mismatch)
