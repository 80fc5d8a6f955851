"""The one validation layer of memopt's inputs, shared by ``python -m memopt.plan`` (through
:mod:`memopt.config.validate`), ``memopt.plan``/``memopt.profile`` and ``memopt.wrap``. It sits with the planner,
whose arguments it checks, so the planner and everything above it (the configs, ``wrap``) import it downward.

Each ``check_*`` function appends one line per problem to ``problems`` (what was wrong and what would work)
and returns the checked value where there is one; :func:`raise_problems` turns the list into one
:class:`InputError` (a ``ValueError``). Nothing here plans or traces: the checks are cheap, so every entry
point runs all of them first and reports everything at once.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import inspect
import math
import numbers
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from memopt.errors import InputError, raise_problems
from memopt.estimate.timing import timing_for
from memopt.hardware import HardwareSpec, hardware_names
from memopt.plan.context import resolve_hardware
from memopt.plan.sample_match import grown_shapes, grown_spec, saved_sample_shapes
from memopt.profile.batch_factories import is_shapes
from memopt.step.batch_samples import batch_size
from memopt.step.batch_tree import is_batch, tensors
from memopt.techniques.checkpointing import checkpointing_refusal
from memopt.techniques.optimizers import VARIANTS
from memopt.units import format_bytes, parse_budget

__all__ = [
    "OPTIMIZER_NAMES",
    "InputError",
    "accepted_hyperparameters",
    "check_budget",
    "check_checkpoint_pins",
    "check_global_batch_pins",
    "check_hardware",
    "check_hyperparameters",
    "check_margin",
    "check_nvme_path",
    "check_optimizer",
    "check_pins_honoured",
    "check_plan_matches",
    "check_positive",
    "check_world",
    "closest",
    "model_fingerprint",
    "profile_fingerprint",
    "raise_problems",
]

#: optimizer names a user may give (``adamw``/``adam``: memopt picks the AdamW variant; ``auto`` likewise)
OPTIMIZER_NAMES: tuple[str, ...] = ("auto", "adamw", "adam", *VARIANTS)


def closest(name: Any, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the one choice that starts with ``name`` (``h100`` -> ``h100_80gb``), else the
    closest by spelling, or ''."""
    choices = [str(c) for c in choices]
    text = str(name)
    prefixed = [c for c in choices if text and c.lower().startswith(text.lower()) and c != text]
    if len(prefixed) == 1:
        return f" (did you mean {prefixed[0]!r}?)"
    match = difflib.get_close_matches(text, choices, n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


# -- budgets and margins ----------------------------------------------------------------------------------------
def check_budget(budget: Any, problems: list[str], *, device_total_bytes: int | None = None,
                 key: str = "budget") -> int | None:
    """The budget in bytes (``memopt.units.parse_budget``), or None with a problem."""
    if budget is None:
        problems.append(f"{key} is required: e.g. {key}=40GB (10^9 bytes), 40GiB (2^30), 80% (of the GPU)")
        return None
    try:
        return parse_budget(budget, device_total_bytes=device_total_bytes)
    except (ValueError, OverflowError, TypeError) as exc:
        problems.append(str(exc).splitlines()[0])
        return None


def check_margin(policy: Any, budget_bytes: int | None, problems: list[str]) -> None:
    """The safety margin must leave something of the budget to plan with."""
    if policy is None or not budget_bytes:
        return
    frac = float(getattr(policy, "margin_fraction", 0.0))
    if frac < 0 or int(getattr(policy, "margin_bytes", 0)) < 0:
        problems.append("policy margin must not be negative; give a share of the budget such as margin=3% or a size "
                        "such as margin=1GiB (null: 2% of the budget + 256 MiB)")
        return
    if not frac < 1:
        problems.append(f"policy margin {100 * frac:g}% of the budget leaves nothing to plan with; give a margin "
                        "below 100% (e.g. margin=3%) or a size such as margin=1GiB")
        return
    margin = policy.margin(budget_bytes)
    if margin >= budget_bytes:
            problems.append(f"policy margin {format_bytes(margin)} is not smaller than the budget "
                        f"{format_bytes(budget_bytes)}; give a smaller margin (e.g. margin=3%) or a larger budget")


# -- world size, paths, hardware ---------------------------------------------------------------------------------
def check_world(world_size: Any, nodes: Any, problems: list[str], *, prefix: str = "",
                names: tuple[str, str] = ("world_size", "nodes")) -> None:
    """``world_size`` and ``nodes``: positive ints (None: the hardware's), ``nodes`` dividing ``world_size``
    (``names``: how the caller calls them; other names than the default skip the divisibility check)."""
    for name, value in zip(names, (world_size, nodes)):
        if value is None:
            continue
        if not _is_int(value) or value < 1:
            hint = f" (write {name}={int(value)} without quotes)" if isinstance(value, str) and value.isdigit() \
                else ""
            problems.append(f"{prefix}{name}={value!r} must be a positive integer{hint}, e.g. {name}=8")
            return
    if names == ("world_size", "nodes") and _is_int(world_size) and _is_int(nodes) and world_size % nodes:
        problems.append(f"{prefix}world_size={world_size} is not a multiple of nodes={nodes}: every node runs the same "
                        f"number of GPUs (e.g. world_size={nodes * max(world_size // nodes, 1)})")


def check_nvme_path(path: Any, problems: list[str], *, key: str = "nvme_path") -> None:
    if path is None:
        return
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        problems.append(f"{key}={path!r} must be a directory path on a local NVMe drive")
    elif not os.path.isdir(path):
        problems.append(f"{key} {str(path)!r} does not exist or is not a directory; create it, or give an existing "
                        "directory on a local NVMe drive (or no nvme_path: no NVMe offload)")


def check_hardware(hardware: Any, problems: list[str]) -> Any:
    """A ``HardwareSpec`` for a name / dict / spec (``auto`` or None: the local GPU), or None with a problem."""
    if isinstance(hardware, HardwareSpec):
        return check_hardware_timing(hardware, problems)
    if hardware is not None and not isinstance(hardware, (str, dict)):
        problems.append(f"hardware must be a shipped name ({', '.join(hardware_names())}), 'auto', a dict or a "
                        f"HardwareSpec, got {type(hardware).__name__}")
        return None
    if isinstance(hardware, str) and hardware != "auto" and hardware not in hardware_names():
        names = hardware_names()
        problems.append(f"unknown hardware {hardware!r}{closest(hardware, names)}; shipped: {', '.join(names)}, "
                        "or 'auto' for the local GPU")
        return None
    try:
        spec = resolve_hardware(hardware)
    except KeyError as exc:  # a dict without a field the spec needs
        needed = [f.name for f in dataclasses.fields(HardwareSpec)
                  if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        problems.append(f"hardware dict lacks {exc.args[0]!r}: give each of {', '.join(needed)}, or a shipped name "
                        f"({', '.join(hardware_names())})")
        return None
    except InputError as exc:  # one line per field, each naming it already
        problems.extend(exc.problems)
        return None
    except (ValueError, TypeError) as exc:
        problems.append(f"hardware: {str(exc).splitlines()[0]}")
        return None
    return check_hardware_timing(spec, problems)


def check_hardware_timing(hw: HardwareSpec, problems: list[str]) -> HardwareSpec | None:
    """``hw``, or None with a problem where its clock constants (``extra.timing``) are not ones the clock has:
    found before anything is traced, not as every candidate of the search failing to estimate."""
    try:
        timing_for(hw)
    except ValueError as exc:
        problems.append(str(exc))
        return None
    return hw


# -- optimizer and hyper-parameters ---------------------------------------------------------------------------------
def check_optimizer(optimizer: Any, problems: list[str], *, key: str = "optimizer") -> None:
    """A name memopt knows, a callable taking the parameters, or None."""
    if optimizer is None or (callable(optimizer) and not isinstance(optimizer, str)):
        return
    if not isinstance(optimizer, str) or optimizer not in OPTIMIZER_NAMES:
        problems.append(f"{key}={optimizer!r} is not an optimizer memopt knows{closest(optimizer, OPTIMIZER_NAMES)}; "
                        f"use one of {', '.join(OPTIMIZER_NAMES)}, or a callable taking the parameters")


def _number(name: str, value: Any, problems: list[str], *, low: float, low_open: bool, high: float | None = None,
            high_open: bool = True, example: str) -> None:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value))
    if ok:
        v = float(value)
        ok = (v > low if low_open else v >= low) and (high is None or (v < high if high_open else v <= high))
    if not ok:
        rng = f"{'>' if low_open else '>='} {low:g}" + (f" and {'<' if high_open else '<='} {high:g}"
                                                          if high is not None else "")
        problems.append(f"{name}={value!r} must be a finite number {rng}, e.g. {name}={example}")


def _torch_arguments(cls: type) -> frozenset[str]:
    # fused / foreach choose the implementation: that is the optimizer variant memopt plans, not a hyper-parameter
    return frozenset(inspect.signature(cls).parameters) - {"params", "fused", "foreach"}


def accepted_hyperparameters(optimizer: Any) -> tuple[str, frozenset[str]] | None:
    """(what the optimizer is, in words; the keyword arguments it takes) for an optimizer memopt builds from
    torch's classes ("adamw" or None: the AdamW variant the planner picks; "sgd"), else None: the 8-bit variants and
    the user's own take arguments of their own."""
    if optimizer in (None, "auto", "adam", "adamw", "adamw_fused", "adamw_foreach"):
        return "AdamW", _torch_arguments(torch.optim.AdamW)
    if optimizer == "sgd":
        return "SGD", _torch_arguments(torch.optim.SGD)
    return None


def check_positive(name: str, value: Any, problems: list[str], *, example: str) -> None:
    """A finite number > 0 (``example``: one that would do)."""
    _number(name, value, problems, low=0.0, low_open=True, example=example)


def check_hyperparameters(kwargs: Mapping[str, Any], problems: list[str], *, prefix: str = "",
                          optimizer: Any = None) -> None:
    """The optimizer's hyper-parameters that memopt passes on (lr, weight_decay, betas, eps, momentum, ...): names
    the optimizer takes (``optimizer``: as ``memopt.wrap`` takes it), values in range."""
    accepted = accepted_hyperparameters(optimizer)
    for name, value in kwargs.items():
        key = f"{prefix}{name}"
        if accepted is not None and name not in accepted[1]:
            problems.append(f"{key}: {accepted[0]} takes no argument {name!r}{closest(name, accepted[1])}; it takes "
                            f"{', '.join(sorted(accepted[1]))}")
            continue
        if value is None:
            continue
        if name == "lr":
            _number(key, value, problems, low=0.0, low_open=True, example="1e-4")
        elif name in ("weight_decay", "momentum", "dampening"):
            _number(key, value, problems, low=0.0, low_open=False, example="0.01" if name == "weight_decay" else "0.9")
        elif name == "eps":
            _number(key, value, problems, low=0.0, low_open=True, example="1e-8")
        elif name == "betas":
            if not isinstance(value, (list, tuple)) or len(value) != 2:
                problems.append(f"{key}={value!r} must be two numbers in [0, 1), e.g. {key}=(0.9, 0.999)")
                continue
            for i, b in enumerate(value):
                _number(f"{key}[{i}]", b, problems, low=0.0, low_open=False, high=1.0, example="0.9")
        elif name == "nesterov" and not isinstance(value, bool):
            problems.append(f"{key}={value!r} must be true or false")


# -- pins against the batch and the plan -------------------------------------------------------------------------
def check_global_batch_pins(pins: Mapping[str, Any] | None, global_batch: Any, problems: list[str], *,
                            key: str = "pins.micro_batch_size", batch_key: str = "batch_size") -> None:
    """A pinned micro-batch must divide the global batch (the plan runs global / micro micro-batches)."""
    mb = (pins or {}).get("micro_batch_size")
    if mb is None or not _is_int(global_batch) or global_batch < 1 or not _is_int(mb) or mb < 1:
        return
    if global_batch % mb:
        divisors = [b for b in range(1, global_batch + 1) if global_batch % b == 0]
        what = "is larger than" if mb > global_batch else "does not divide"
        problems.append(f"{key}={mb} {what} the global batch {global_batch} ({batch_key}); use one of "
                        f"{', '.join(map(str, divisors))}")


def check_checkpoint_pins(pins: Mapping[str, Any] | None, profile: Any, problems: list[str]) -> None:
    """Pinned checkpointing needs blocks to checkpoint: memopt checkpoints the blocks of the model's stacks, and a
    pinned block count must not exceed what a stack has."""
    pins = pins or {}
    mode, blocks = pins.get("checkpointing"), pins.get("checkpoint_blocks")
    if mode in (None, "none") and not blocks:  # 0 blocks is no checkpointing, which every model can do
        return
    total = max(profile.full_block_counts, default=0)
    if total == 0:
        problems.append(f"pin {'checkpointing=' + repr(mode) if mode not in (None, 'none') else 'checkpoint_blocks'} "
                        f"cannot be honoured: {profile.model_class} has no repeated blocks to checkpoint (memopt "
                        "checkpoints the blocks of a stack: an nn.ModuleList, nn.Sequential or nn.ModuleDict of two or "
                        "more distinct modules of one class; one module listed n times shares its weights and is not "
                        "one); drop the pin")
    elif mode not in (None, "none") and profile.model_class.startswith("PeftModel") and (
            why := checkpointing_refusal(profile.model())) is not None:
        problems.append(f"pin checkpointing={mode!r} cannot be honoured: {why}; drop the pin")
    elif _is_int(blocks) and blocks > total:
        problems.append(f"pin checkpoint_blocks={blocks} is more than the {total} blocks of {profile.model_class}'s "
                        f"largest stack; use 1 to {total}")


# pins a plan can fail to honour, and how the plan's strategy shows the value
_PIN_FIELDS = ("precision", "activation_offload", "attention", "chunked_ce", "ce_kernel", "optimizer",
               "micro_batch_size", "expandable_segments")


def check_pins_honoured(plan: Any, pins: Mapping[str, Any] | None) -> None:
    """Raise ``InputError`` when a fitting plan does not apply a pinned value (offload plans run their own engine
    and cannot apply every technique): a pin is never silently dropped."""
    if not pins or plan is None or not getattr(plan, "fits", False):
        return
    s = plan.strategy
    problems: list[str] = []
    for key in _PIN_FIELDS:
        if key not in pins:
            continue
        have = getattr(s, key)
        if have != pins[key]:
            engine = "the offload plan" if s.extra("sharding") is not None else "the plan"
            problems.append(f"pin {key}={pins[key]!r} cannot be honoured by {engine} [{s.label()}] (it runs "
                            f"{key}={have!r}); drop the pin, or pin offload=false to keep it on a plan without "
                            "offload")
    if "offload" in pins:
        setting = s.extra("sharding")
        offloads = setting is not None and any(
            str(getattr(setting, k, None) if not isinstance(setting, dict) else setting.get(k)) not in ("none", "None")
            for k in ("offload_optimizer", "offload_params"))
        if bool(pins["offload"]) != offloads:
            how = ("on one GPU, offload is planned only where nothing fits without it; give world_size= (or "
                   "hardware.gpus_per_node) to plan engines that offload, or drop the pin") if pins["offload"] else \
                "drop the pin, or give a larger budget"
            problems.append(f"pin offload={pins['offload']!r} cannot be honoured: the plan [{s.label()}] "
                            f"{'does not offload' if pins['offload'] else 'offloads'}; {how}")
    cp = pins.get("checkpointing")
    if cp is not None and s.checkpointing.mode != cp and not (cp == "none" and s.checkpointing.label() == "none"):
        problems.append(f"pin checkpointing={cp!r} cannot be honoured by the plan [{s.label()}]; drop the pin or "
                        "pin offload=false")
    raise_problems(problems, "pins")


# -- model specs ---------------------------------------------------------------------------------------------------
# -- saved plans -------------------------------------------------------------------------------------------------
def _fingerprint(model_class: str, numels: Iterable[int]) -> str:
    text = f"{model_class}:" + ",".join(map(str, sorted(int(n) for n in numels)))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def profile_fingerprint(profile: Any) -> str:
    """The model's fingerprint as a profile saw it: its class and the sizes of its distinct parameters."""
    return _fingerprint(str(profile.model_class), (n for n, *_ in profile.param_sizes))


def model_fingerprint(model: Any) -> str | None:
    """The same fingerprint of an ``nn.Module`` (None for anything else)."""
    if not isinstance(model, torch.nn.Module):
        return None
    seen: set[int] = set()
    numels = []
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            numels.append(p.numel())
    return _fingerprint(type(model).__name__, numels)


def check_plan_matches(plan: Any, model: Any, sample: Any = None, *, allow_mismatch: bool = False) -> None:
    """Refuse a saved plan made for another model (or another global batch) unless ``allow_mismatch``."""
    if allow_mismatch or plan is None:
        return
    problems: list[str] = []
    stored = (plan.model or {}).get("fingerprint")
    mine = model_fingerprint(model)
    if stored and mine and stored != mine:
        name = (plan.model or {}).get("name") or (plan.model or {}).get("class")
        problems.append(f"the saved plan was made for another model ({name}, {(plan.model or {}).get('num_params')} "
                        f"parameters; this one is {type(model).__name__}); make a plan for this model, or pass "
                        "allow_plan_mismatch=True to apply it anyway")
    batch = _samples_in(sample)
    if _is_int(batch) and plan.global_batch and batch != plan.global_batch:
        problems.append(f"the saved plan is for a global batch of {plan.global_batch}, the sample has batch_size="
                        f"{batch}; make a plan for this batch, or pass allow_plan_mismatch=True")
    planned = (plan.model or {}).get("sample")
    grown = grown_spec(planned, sample) or _grown_tensors(planned, model, sample)
    if grown:
        problems.append(f"the sample is larger per sample than the saved plan's: {'; '.join(grown)}; its activations "
                        "need more memory than the plan predicts: make a plan for this sample, or pass "
                        "allow_plan_mismatch=True")
    raise_problems(problems, "plan")


def _grown_tensors(planned: Any, model: Any, sample: Any) -> list[str]:
    """Each tensor of a batch ``sample`` larger past dim 0 than in the saved plan's recorded sample."""
    if sample is None or is_shapes(sample) or not (is_batch(sample) and tensors(sample)):
        return []
    try:
        grown = grown_shapes(saved_sample_shapes(planned, model), sample)
    except ValueError:  # a batch memopt cannot split says so where it is traced
        return []
    return [f"{path} {shape} (planned per sample {want})" for path, _, shape, want in grown]


def _samples_in(sample: Any) -> Any:
    """The samples a wrap's ``sample`` holds: its ``batch_size`` as shapes, else the batch's dim 0 (None: no
    batch to count)."""
    if sample is None or is_shapes(sample):
        return sample.get("batch_size") if isinstance(sample, Mapping) else None
    if not (is_batch(sample) and tensors(sample)):
        return None
    try:
        return batch_size(sample)
    except ValueError:  # a batch memopt cannot split says so where it is traced
        return None
