"""Low-rank adapters (LoRA, DoRA) via peft: the base model is frozen and only small adapters train.

This changes the training method (a plan must say so: ``memopt.techniques.quantization.method_change_note``),
so the planner chooses it only under the policy allowance ``"adapters"``.

Targets are found automatically: every ``nn.Linear`` inside the model's repeated blocks (attention and MLP
projections; bitsandbytes' quantized linears are ``nn.Linear`` subclasses and count too), never the
embeddings or the LM head. A classifier's task head (``classifier``, ``score``, ``qa_outputs``: made fresh for
the task) trains beside the adapters, as peft's task types keep it (``modules_to_save``), in place.
``apply_adapters`` wraps the model with ``peft.get_peft_model``; the module tree is changed in place (each target
becomes a peft LoRA layer around the original module), so the original model object runs with the adapters too.
Its undo merges the trained adapters into the weights they sit on (:mod:`memopt.techniques.adapter_merge`) and
unloads them: the original modules come back, holding what was trained, with every ``requires_grad`` flag as it was.

What the adapters cost in bytes, from the targets' shapes alone, is in :mod:`memopt.techniques.adapter_bytes`.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from memopt.blocks import find_block_stacks
from memopt.techniques.adapter_merge import merge_adapters, task_heads
from memopt.techniques.model_change import ModelChange, Undo, no_change

__all__ = [
    "ADAPTER_KINDS",
    "DEFAULT_ADAPTER_RANK",
    "AdapterSetting",
    "ExtraSettings",
    "adapter_state_dict",
    "apply_adapters",
    "change_model",
    "find_target_linears",
    "load_adapter_state_dict",
    "peft_installed",
    "target_shapes",
]

ADAPTER_KINDS: tuple[str, ...] = ("lora", "dora")

def peft_installed() -> bool:
    """Whether peft is installed, without importing it (the planner only needs to know adapters can be made)."""
    import importlib.util

    return importlib.util.find_spec("peft") is not None

ADAPTER_FIDELITY = "adapters"  # the policy allowance this technique needs
#: the LoRA rank the planner adds when it adds adapters (pin ``adapter_rank`` for another)
DEFAULT_ADAPTER_RANK = 16


class ExtraSettings(dict):
    """Settings as ``Strategy.extras`` keeps them: a plain dict for JSON and for ``prepare``, read-only and
    hashable so strategies stay hashable (lists are stored as tuples)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        data = dict(*args, **kwargs)
        super().__init__({k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))

    def _read_only(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("strategy extras are read-only; build a new strategy with memopt.techniques."
                        "quantization.with_extra")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _read_only  # type: ignore[assignment]

    def __reduce__(self) -> Any:
        return (ExtraSettings, (dict(self),))

    def __copy__(self) -> ExtraSettings:
        return self

    def __deepcopy__(self, memo: Any) -> ExtraSettings:
        return self


@dataclass(frozen=True, kw_only=True)
class AdapterSetting:
    """LoRA (or DoRA: LoRA plus a learned per-output magnitude) of rank ``r`` on ``targets``.

    ``targets``: module names (full dotted names, or suffixes such as ``"q_proj"``, as peft matches them);
    None finds them automatically (:func:`find_target_linears`). The adapter output is scaled by
    ``alpha / r``.
    """

    kind: Literal["lora", "dora"] = "lora"
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    targets: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.kind not in ADAPTER_KINDS:
            problems.append(f"kind must be one of {ADAPTER_KINDS}, got {self.kind!r}")
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r < 1:
            problems.append(f"r must be a positive integer, got {self.r!r}")
        if not isinstance(self.alpha, (int, float)) or self.alpha <= 0:
            problems.append(f"alpha must be positive, got {self.alpha!r}")
        if not 0.0 <= float(self.dropout) < 1.0:
            problems.append(f"dropout must be in [0, 1), got {self.dropout!r}")
        if self.targets is not None and (isinstance(self.targets, str) or not all(
                isinstance(t, str) for t in self.targets) or not self.targets):
            problems.append("targets must be a non-empty tuple of module names, or None to find them automatically")
        if problems:
            raise ValueError("invalid adapter setting: " + "; ".join(problems))
        if self.targets is not None and not isinstance(self.targets, tuple):
            object.__setattr__(self, "targets", tuple(self.targets))

    @property
    def scaling(self) -> float:
        return self.alpha / self.r

    @classmethod
    def parse(cls, value: Any) -> AdapterSetting:
        """From a setting, a dict (``Strategy.extras`` after ``from_dict``), or a tuple of (key, value) pairs."""
        if isinstance(value, cls):
            return value
        data = setting_fields(cls, value, "adapter")
        if data.get("targets") is not None:
            data["targets"] = tuple(data["targets"])
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["targets"] = list(self.targets) if self.targets is not None else None
        return d

    def as_extra(self) -> ExtraSettings:
        """The form ``Strategy.extras`` keeps ("adapters", this)."""
        return ExtraSettings(self.to_dict())

    def label(self) -> str:
        return f"{self.kind}(r={self.r},alpha={self.alpha:g})"


# --------------------------------------------------------------------------------------------------------
# targets
# --------------------------------------------------------------------------------------------------------

def setting_fields(cls: type, value: Any, what: str) -> dict[str, Any]:
    """The fields of a settings dataclass ``cls`` from a dict or a tuple of (key, value) pairs (how
    ``Strategy.extras`` carries them), every unknown key named with the valid ones."""
    if isinstance(value, (tuple, list)) and all(isinstance(v, (tuple, list)) and len(v) == 2 for v in value):
        value = dict(value)
    if not isinstance(value, dict):
        raise ValueError(f"{what} settings must be a {cls.__name__} or a dict, got {type(value).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"unknown {what} setting(s) {unknown}; valid: {sorted(known)}")
    return dict(value)


def _embedding_modules(model: nn.Module) -> set[int]:
    out: set[int] = set()
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        fn = getattr(model, getter, None)
        if callable(fn):
            try:
                module = fn()
            except Exception:
                module = None
            if module is not None:
                out.add(id(module))
    return out


def _conv1d_class() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except Exception:  # pragma: no cover - transformers is a dependency
        return None
    return Conv1D


def find_target_linears(model: nn.Module, *, include_conv1d: bool = False) -> list[str]:
    """Full names of every ``nn.Linear`` inside the model's repeated blocks, in module order.

    Embeddings and the LM head are never targets (they sit outside the blocks, and are excluded by identity
    where a model ties them into a block). Linears that are parts of peft adapters are skipped.
    ``include_conv1d`` also takes transformers' ``Conv1D`` (GPT-2's projections: peft adapts them; bitsandbytes
    does not quantize them). Mixture-of-experts experts stored as fused 3-D parameters are not modules, so
    they are never targets (their shared experts and gates are)."""
    exclude = _embedding_modules(model)
    conv1d = _conv1d_class() if include_conv1d else None
    kinds = (nn.Linear, conv1d) if conv1d is not None else (nn.Linear,)
    names: list[str] = []
    for stack in find_block_stacks(model):
        for i, block in enumerate(stack.blocks):
            for sub, module in block.named_modules():
                if not isinstance(module, kinds) or id(module) in exclude:
                    continue
                if any(part.startswith("lora_") for part in sub.split(".")):
                    continue
                if hasattr(module, "base_layer"):  # a peft layer wrapping a linear: its base is the target
                    continue
                names.append(f"{stack.path}.{i}.{sub}" if sub else f"{stack.path}.{i}")
    return names


def target_shapes(model: nn.Module, targets: Sequence[str] | None = None) -> list[tuple[int, int]]:
    """(out_features, in_features) of each target (found automatically, Conv1D included, when ``targets`` is
    None)."""
    names = list(targets) if targets is not None else find_target_linears(model, include_conv1d=True)
    out = []
    for name in names:
        module = model.get_submodule(name)
        if hasattr(module, "out_features"):
            out.append((int(module.out_features), int(module.in_features)))
        else:  # transformers Conv1D: weight (in, out)
            out.append((int(module.weight.shape[1]), int(module.weight.shape[0])))
    return out


# --------------------------------------------------------------------------------------------------------
# applying
# --------------------------------------------------------------------------------------------------------

def _peft() -> Any:
    try:
        import peft
    except Exception as exc:  # pragma: no cover - depends on the environment
        raise ValueError("adapters need peft: pip install 'memopt[peft]'") from exc
    return peft


def _autocast_query_of(forward: Callable[..., Any]) -> Callable[..., Any]:
    """peft's LoRA layers ask ``torch.is_autocast_enabled()`` with no device, which means CUDA. In a trace on
    CPU fake tensors (CUDA emulated under CPU autocast) that answers False where the GPU run answers True; while
    the layer runs, the question is answered for the device of its input instead."""

    @functools.wraps(forward)
    def wrapped(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        original = torch.is_autocast_enabled
        device_type = x.device.type if isinstance(x, torch.Tensor) else "cuda"

        def is_autocast_enabled(device: Any = None) -> bool:
            return original(device_type if device is None else device)

        torch.is_autocast_enabled = is_autocast_enabled
        try:
            return forward(x, *args, **kwargs)
        finally:
            torch.is_autocast_enabled = original

    return wrapped


def _materialize_fake(model: nn.Module) -> None:
    """Give the adapters that peft made on meta (``low_cpu_mem_usage``) fake storage next to their base layer.

    A fake model cannot take peft's usual route: peft moves new adapters with ``Module.to``, and torch cannot swap
    a fake parameter made by ``detach`` (every new ``nn.Parameter`` made under fake mode), which holds a weak
    reference. So peft builds the adapters outside fake mode, on meta, and they get fake storage here. The dtype is
    the one peft ends with: adapters are made in fp32, moved to the base dtype, and fp16/bf16 cast back to fp32
    (``autocast_adapter_dtype``)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for layer in model.modules():
        if not isinstance(layer, BaseTunerLayer):
            continue
        base = layer.get_base_layer()
        ref = getattr(base, "weight", None)
        device = ref.device if ref is not None else None
        for module in layer.modules():
            if module is base or any(module is m for m in base.modules()):
                continue
            for key, p in list(module._parameters.items()):
                if p is not None and p.device.type == "meta":
                    dtype = p.dtype if p.dtype not in (torch.float16, torch.bfloat16) else torch.float32
                    module._parameters[key] = nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device),
                                                           requires_grad=p.requires_grad)
            for key, b in list(module._buffers.items()):
                if b is not None and b.device.type == "meta":
                    module._buffers[key] = torch.empty(b.shape, dtype=b.dtype, device=device)


def change_model(change: ModelChange) -> Undo:
    """The adapters' change: every weight frozen and trainable adapters put on the target linears (after
    quantization, so a quantized linear gets its adapter, and after the move, so adapters start on the device)."""
    setting = change.strategy.extra("adapters")
    if setting is None:
        return no_change
    return apply_adapters(change.model, setting, fake=change.fake, originals=change.quantized_originals)[1]


def apply_adapters(model: nn.Module, setting: AdapterSetting | dict[str, Any], *, fake: bool = False,
                   originals: Mapping[str, nn.Module] | None = None) -> tuple[nn.Module, Callable[[], None]]:
    """Freeze ``model`` but its task heads (:func:`memopt.techniques.adapter_merge.task_heads`) and add trainable
    adapters to its target linears; returns (the peft model, undo). The undo merges the trained adapters into the
    weights (``originals``: the full-precision modules of a base quantized before, by name) and takes them off.

    The peft model wraps ``model``, whose modules are changed in place, so ``model`` itself also runs with the
    adapters (memopt's train step keeps calling it). ``fake``: the model is a fake-tensor copy being traced
    (the adapters are created as fake tensors; LoRA layers answer autocast queries for the traced device).
    """
    setting = AdapterSetting.parse(setting)
    if type(model).__module__.startswith("peft."):
        raise ValueError(f"the model is a peft model already ({type(model).__name__}): memopt puts no adapters of "
                         "its own on it; train it as it is (a fidelity without 'adapters', or pin adapter_rank=0)")
    peft = _peft()
    targets = list(setting.targets) if setting.targets is not None else find_target_linears(model, include_conv1d=True)
    if not targets:
        raise ValueError("found no linear layers inside repeated blocks to put adapters on; pass "
                         "AdapterSetting(targets=(...module names...))")
    flags = [(p, p.requires_grad) for p in model.parameters()]
    attrs_before = set(vars(model))
    config = peft.LoraConfig(r=setting.r, lora_alpha=setting.alpha, lora_dropout=setting.dropout,
                             target_modules=targets, use_dora=setting.kind == "dora", bias="none")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")  # peft sets it itself for Conv1D
        # peft reads transformers 5's deprecated `is_gradient_checkpointing`: once per traced variant, not the user's
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        if fake:
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():  # adapters made as real meta tensors, then given fake storage
                peft_model = peft.get_peft_model(model, config, low_cpu_mem_usage=True)
        else:
            peft_model = peft.get_peft_model(model, config)
    for head in task_heads(model):
        model.get_submodule(head).requires_grad_(True)
    wrapped: list[nn.Module] = []
    if fake:
        _materialize_fake(model)
        from peft.tuners.lora import LoraLayer

        for module in model.modules():
            if isinstance(module, LoraLayer) and "forward" not in module.__dict__:
                module.forward = _autocast_query_of(module.forward)
                wrapped.append(module)

    def undo() -> None:
        for module in wrapped:
            del module.forward
        if not fake:
            merge_adapters(model, originals or {})
        peft_model.unload()  # peft: replace each LoRA layer by its base layer (merged above)
        for p, flag in flags:
            p.requires_grad_(flag)
        for name in set(vars(model)) - attrs_before:
            if name not in ("_modules", "_parameters", "_buffers"):
                delattr(model, name)

    return peft_model, undo


_PEFT_PREFIX = "base_model.model."


def _adapter_params(model: nn.Module) -> dict[str, nn.Parameter]:
    out = {}
    for name, p in model.named_parameters():
        if any(part.startswith("lora_") for part in name.split(".")):
            out[name.removeprefix(_PEFT_PREFIX)] = p
    return out


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights (LoRA A and B, DoRA magnitudes) by parameter name, detached: the same keys for the
    model and for its peft wrapper, so they load into any model with the same adapters (quantized or not)."""
    return {name: p.detach() for name, p in _adapter_params(model).items()}


def load_adapter_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy adapter weights saved by :func:`adapter_state_dict` into ``model``'s adapters (every one must match)."""
    params = _adapter_params(model)
    state = {k.removeprefix(_PEFT_PREFIX): v for k, v in state.items()}
    missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    if missing or unexpected:
        raise ValueError(f"adapter weights do not match the model's adapters: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}")
    with torch.no_grad():
        for name, p in params.items():
            if tuple(state[name].shape) != tuple(p.shape):
                raise ValueError(f"{name}: saved shape {tuple(state[name].shape)}, the model has {tuple(p.shape)}")
            p.copy_(state[name])
