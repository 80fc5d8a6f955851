"""A one-GPU checkpoint of ``Wrapped``: the training state it holds (model, optimizer, fp32 masters, gradient scaler,
learning-rate schedule, random generators), written whole or not at all, read back and checked against the wrapped
model before anything is loaded, and loaded all or nothing: a checkpoint that failed half-way through loading would
leave new weights beside the old optimizer state.

The full-precision truth of a trained parameter is its fp32 master where the checkpoint holds one (a bf16_master
plan saved it) and its saved weight otherwise, whichever plan loads it: a bf16_master plan starts its masters from
it, and a plan without masters takes the masters into its parameters, so resuming under another precision loses
nothing the checkpoint kept."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memopt.step.prepare import Prepared
from memopt.techniques.precision import MasterWeights

__all__ = ["optimizer_mismatch", "random_state", "read_checkpoint", "restore_random_state", "restore_training_state",
           "state_mismatch", "training_state", "write_checkpoint"]

# the random generators' states, so that a resumed run draws what the uninterrupted one would have (its dropout
# masks, the script's own sampling); named by the keys of the Hugging Face Trainer's rng_state.pth
RNG_KEY = "rng_state"

# keys the learning-rate schedulers write into an optimizer's parameter groups: a checkpoint saved with a schedule
# holds them whatever its optimizer
_SCHEDULE_KEYS = frozenset({"initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum"})

_WEIGHTS_ONLY = ("load only its weights, into the model before memopt.wrap: "
                 "model.load_state_dict(torch.load(path, weights_only=False)['model'])")


def training_state(model: nn.Module, prepared: Prepared, **counters: Any) -> dict[str, Any]:
    """What a checkpoint holds of a prepared model besides ``counters`` (the steps done, the data position, the
    plan): the user's model, the optimizer (and its class, so another optimizer's wrap refuses it), the random
    generators, and the fp32 masters (named by their parameters), gradient scaler and schedule where they exist."""
    step = prepared.step
    optimizer = prepared.optimizer
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "optimizer_class": _class_name(optimizer), RNG_KEY: random_state(), **counters}
    if step.master is not None:
        state["master_weights"] = step.master.state_dict()
        names = {id(p): n for n, p in model.named_parameters()}
        if all(id(p) in names for p in step.master.params):  # else read back as an older checkpoint's
            state["master_weights"]["names"] = [names[id(p)] for p in step.master.params]
    if step.scaler is not None and hasattr(step.scaler, "state_dict"):
        state["grad_scaler"] = step.scaler.state_dict()
    if step.lr_scheduler is not None:
        state["lr_scheduler"] = step.lr_scheduler.state_dict()
    return state


def restore_training_state(model: nn.Module, prepared: Prepared, state: dict[str, Any]) -> None:
    """Load ``training_state``'s dict into ``model`` and ``prepared``, all or nothing: another model's or another
    optimizer's is refused before anything is loaded, and a part that still fails to load puts back every part
    loaded before it."""
    optimizer = prepared.optimizer
    lacking = [k for k in ("model", "optimizer") if not isinstance(state, dict) or k not in state]
    if lacking:
        raise ValueError(f"this is not a memopt checkpoint (it has no {' or '.join(repr(k) for k in lacking)}): pass "
                         "what wrapped.state_dict() returned, or load the folder wrapped.save(dir) wrote")
    problems = _model_problems(model, state)
    if not problems:
        other = optimizer_mismatch(optimizer, state)
        if other is not None:
            raise ValueError(other)
        problems = _group_problems(optimizer, state) + _master_problems(model, state)
    if problems:
        raise ValueError(f"this checkpoint was saved from another model or optimizer ({'; '.join(problems)}): load "
                         "it into the model and optimizer it was saved from")
    step = prepared.step
    # each part: what it is, what keeps the state it replaces (returning the undo), and its load
    parts: list[tuple[str, Callable[[], Callable[[], None]], Callable[[], Any]]] = [
        ("optimizer state", lambda: _kept_optimizer(optimizer), lambda: optimizer.load_state_dict(state["optimizer"]))]
    if "grad_scaler" in state and step.scaler is not None:
        parts.append(("gradient scaler", lambda: _kept_small(step.scaler),
                      lambda: step.scaler.load_state_dict(state["grad_scaler"])))
    if "lr_scheduler" in state and step.lr_scheduler is not None:
        parts.append(("learning-rate schedule", lambda: _kept_small(step.lr_scheduler),
                      lambda: step.lr_scheduler.load_state_dict(state["lr_scheduler"])))
    # the weights after the parts that hold a few numbers: keeping them copies the model to the host
    parts.append(("weights", lambda: _kept_weights(model, step.master),
                  lambda: _load_weights(model, step.master, state)))
    if state.get(RNG_KEY) is not None:
        parts.append(("random generator state", _kept_random, lambda: restore_random_state(state[RNG_KEY])))
    undo: list[Callable[[], None]] = []
    for what, keep, load in parts:
        try:
            undo.append(keep())
            load()
        except BaseException as exc:
            while undo:
                undo.pop()()
            if not isinstance(exc, Exception):
                raise
            reason = (str(exc).strip().splitlines() or [""])[0]
            raise ValueError(f"this checkpoint's {what} does not load into this wrap ({type(exc).__name__}: "
                             f"{reason}), so nothing of it was loaded: resume from a checkpoint saved by a wrap made "
                             "with the same model, optimizer, lr_scheduler and precision") from exc
    step.scheduler_watch.forget()  # the schedule's position is the checkpoint's now, not a step of the script's


def random_state() -> dict[str, Any]:
    """The state of every random generator a training step or script draws from: torch's on the CPU and on each
    initialized GPU, Python's, numpy's (as a tensor, so that the checkpoint still loads with weights_only=True)."""
    state: dict[str, Any] = {"python": random.getstate(), "cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = _numpy()
    if np is not None:
        kind, key, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(key.copy()), pos, has_gauss, cached)
    return state


def restore_random_state(state: dict[str, Any]) -> None:
    """Set the generators ``random_state`` recorded; one it did not record (CUDA not initialized then, numpy not
    installed) keeps its state, and GPUs beyond those recorded keep theirs."""
    if "cpu" in state:
        torch.set_rng_state(state["cpu"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        for index, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, index)
    if "python" in state:
        random.setstate(state["python"])
    np = _numpy()
    if np is not None and state.get("numpy") is not None:
        kind, key, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, key.numpy() if isinstance(key, torch.Tensor) else key, pos, has_gauss, cached))


def write_checkpoint(file: Path, state: dict[str, Any]) -> None:
    """``state`` into ``file`` through a temporary beside it, so that a save that fails never leaves a half-written
    checkpoint where the last good one was."""
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(file.suffix + ".tmp")
    torch.save(state, tmp)
    tmp.replace(file)


def read_checkpoint(file: Path) -> dict[str, Any]:
    """The state ``Wrapped.save`` wrote to ``file``; one-line errors for a file that is not one."""
    try:
        state = torch.load(file, weights_only=False)
    except Exception as exc:  # truncated, overwritten, or another format: the reason is torch's own
        raise ValueError(f"the memopt checkpoint {file} cannot be read ({type(exc).__name__}: {exc}): it is "
                         "truncated or not a file wrapped.save wrote; resume from another checkpoint") from exc
    if not isinstance(state, dict) or not {"model", "optimizer"} <= set(state):
        raise ValueError(f"{file} is not a memopt checkpoint (wrapped.save writes a dict holding 'model' and "
                         "'optimizer'); load a model's own state_dict with model.load_state_dict before memopt.wrap")
    return state


def state_mismatch(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> str | None:
    """Why ``state`` cannot be loaded into ``model`` and ``optimizer`` whole (None: it can): the parameters and
    buffers it names and their shapes, the optimizer's kind and the sizes of its parameter groups, and the fp32
    masters against the parameters they are named by."""
    problems = _model_problems(model, state)
    if not problems:
        other = optimizer_mismatch(optimizer, state)
        problems = [other] if other is not None else _group_problems(optimizer, state) + _master_problems(model, state)
    return "; ".join(problems) or None


def optimizer_mismatch(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> str | None:
    """Why ``state``'s optimizer state is another kind of optimizer's than ``optimizer`` (None: the same kind), as
    one line saying what would work. A checkpoint names its optimizer's class; an older one that does not is judged
    by its keys: a kind's parameter groups (and per-parameter states) hold hyper-parameters (and states) the other
    kind's have not, both ways, where another torch version or a schedule only ever adds keys one way."""
    own = type(optimizer).__name__
    saved = state["optimizer"]
    theirs_class = state.get("optimizer_class")
    detail = ""
    if theirs_class is not None:
        if theirs_class == _class_name(optimizer):
            return None
        theirs = theirs_class.rsplit(".", 1)[-1]
    else:
        theirs = _saved_optimizer_value(state) or "another optimizer"
        mine_state = optimizer.state_dict()
        groups = _differ_both_ways(_hyper_keys(saved.get("param_groups", [])), _hyper_keys(optimizer.param_groups))
        states = _differ_both_ways(*_first_common_state_keys(saved.get("state", {}), mine_state["state"]))
        if groups is None and states is None:
            return None
        extra, missing = groups if groups is not None else states
        holds = "parameter groups set" if groups is not None else "per-parameter states hold"
        detail = f" (its {holds} {_listed(sorted(extra))}, this one's {_listed(sorted(missing))})"
    value = _saved_optimizer_value(state)
    hint = f" (memopt.wrap(..., optimizer={value!r}))" if value is not None else ""
    return (f"this checkpoint holds the state of {theirs} and this wrap steps {own}{detail}: wrap with the optimizer "
            f"it was saved with{hint}, or {_WEIGHTS_ONLY}")


# -- checks ----------------------------------------------------------------------------------------


def _listed(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _model_problems(model: nn.Module, state: dict[str, Any]) -> list[str]:
    mine = model.state_dict()
    theirs = state["model"]
    problems = []
    missing = [k for k in mine if k not in theirs]
    extra = [k for k in theirs if k not in mine]
    not_tensors = [k for k, v in mine.items() if isinstance(v, torch.Tensor) and k in theirs
                   and not isinstance(theirs[k], torch.Tensor)]
    shapes = [f"{k} {tuple(theirs[k].shape)} vs {tuple(v.shape)}" for k, v in mine.items()
              if k in theirs and isinstance(theirs[k], torch.Tensor) and theirs[k].shape != v.shape]
    if missing:
        problems.append(f"it lacks {_listed(missing)}")
    if extra:
        problems.append(f"it has {_listed(extra)}, which the model has not")
    if not_tensors:
        problems.append(f"it holds no tensor for {_listed(not_tensors)}")
    if shapes:
        problems.append(f"shapes differ: {_listed(shapes)}")
    return problems


def _group_problems(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> list[str]:
    groups = [len(g["params"]) for g in state["optimizer"].get("param_groups", [])]
    own = [len(g["params"]) for g in optimizer.param_groups]
    return [] if groups == own else [f"its optimizer has parameter groups of {groups} parameters, this one {own}"]


def _master_problems(model: nn.Module, state: dict[str, Any]) -> list[str]:
    saved = state.get("master_weights")
    if saved is None:
        return []
    masters = saved.get("masters", [])
    names = _saved_master_names(model, saved)
    if len(names) != len(masters):
        return [f"it holds {len(masters)} fp32 master weights and names {len(names)} parameters for them"]
    theirs = state["model"]
    unknown = [n for n in names if n not in theirs]
    if unknown:
        return [f"its fp32 master weights name {_listed(unknown)}, which its model has not"]
    shapes = [f"{n} {tuple(m.shape)} vs {tuple(theirs[n].shape)}" for n, m in zip(names, masters)
              if m.shape != theirs[n].shape]
    return [f"its fp32 master weights' shapes differ from its weights': {_listed(shapes)}"] if shapes else []


def _class_name(optimizer: torch.optim.Optimizer) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def _saved_optimizer_value(state: dict[str, Any]) -> str | None:
    """The memopt optimizer name the checkpoint's plan used ('sgd', 'adamw_fused'), None for the user's own."""
    plan = state.get("plan")
    value = plan.get("techniques", {}).get("optimizer") if isinstance(plan, dict) else None
    return value if isinstance(value, str) and value != "user" else None


def _hyper_keys(groups: list[dict[str, Any]]) -> set[str]:
    return {k for g in groups for k in g} - {"params", "param_names"} - _SCHEDULE_KEYS


def _first_common_state_keys(theirs: dict[Any, Any], mine: dict[Any, Any]) -> tuple[set[str], set[str]]:
    common = next((k for k in mine if k in theirs), None)
    if common is None:  # a fresh optimizer has no state yet to compare with
        return set(), set()
    return set(theirs[common]), set(mine[common])


def _differ_both_ways(theirs: set[str], mine: set[str]) -> tuple[set[str], set[str]] | None:
    extra, missing = theirs - mine, mine - theirs
    return (extra, missing) if extra and missing else None


# -- loading ---------------------------------------------------------------------------------------


def _names_of(model: nn.Module, params: list[nn.Parameter]) -> list[str]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for p in params]


def _saved_master_names(model: nn.Module, saved: dict[str, Any]) -> list[str]:
    """The parameters a checkpoint's masters belong to. An older checkpoint does not name them: its masters are
    those of its trainable parameters, which are the loading model's where its model state matched."""
    names = saved.get("names")
    if names is not None:
        return list(names)
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _kept_optimizer(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    # load_state_dict rebinds the optimizer's state and parameter groups to new objects rather than writing into
    # the old ones, so holding the old attributes is the whole undo, at no memory cost
    before = dict(optimizer.__dict__)

    def undo() -> None:
        optimizer.__dict__.clear()
        optimizer.__dict__.update(before)

    return undo


def _kept_small(holder: Any) -> Callable[[], None]:
    """A gradient scaler's or schedule's state, whose own state dict (a few numbers) is the undo."""
    before = copy.deepcopy(holder.state_dict())

    def undo() -> None:
        if before:  # a disabled scaler's state is empty and loads nothing
            holder.load_state_dict(copy.deepcopy(before))

    return undo


def _kept_weights(model: nn.Module, master: MasterWeights | None) -> Callable[[], None]:
    """The weights and masters there are, kept in host memory, never beside them on the GPU, whose room the plan
    has budgeted."""
    before = {k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else copy.deepcopy(v)
              for k, v in model.state_dict().items()}
    masters = master.masters if master is not None else []
    masters_before = [m.detach().to("cpu", copy=True) for m in masters]

    def undo() -> None:
        model.load_state_dict(before)
        with torch.no_grad():
            for m, value in zip(masters, masters_before):
                m.copy_(value)

    return undo


def _load_weights(model: nn.Module, master: MasterWeights | None, state: dict[str, Any]) -> None:
    """The model's state, and the full-precision truth into the masters (or, without masters, into the parameters
    the checkpoint holds masters of)."""
    saved = state.get("master_weights")
    truth = dict(zip(_saved_master_names(model, saved), saved["masters"])) if saved is not None else {}
    model.load_state_dict(state["model"])
    with torch.no_grad():
        if master is not None:
            for name, m in zip(_names_of(model, master.params), master.masters):
                m.copy_(truth[name] if name in truth else state["model"][name])
        else:
            params = dict(model.named_parameters())
            for name, value in truth.items():
                if name in params:
                    params[name].copy_(value)


def _kept_random() -> Callable[[], None]:
    before = random_state()
    return lambda: restore_random_state(before)


def _numpy() -> Any:
    try:
        import numpy as np
    except ImportError:  # numpy is optional for memopt
        return None
    return np
