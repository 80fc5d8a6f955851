"""Whether the batch's dim 0 is the samples, for models whose layers say where their batch axis is.

Micro-batching splits every tensor of the batch along dim 0 and is exact only when dim 0 holds independent samples.
A recurrent layer or ``nn.MultiheadAttention`` built with ``batch_first=False`` (PyTorch's default for both) takes
``(sequence, batch, features)``; a loop that feeds it sequence-first batches puts the time steps on dim 0, and a
micro-batch would then be a slice of time steps: the recurrence restarts and attention sees part of the sequence,
so the loss changes silently. Such a model may also transpose a batch-first input itself, so the layer's flag alone
says nothing; what does is how the layer's batch axis grows with the number of samples fed. One forward of a fake
copy (no memory, no values) at 1 and at 2 samples: a layer whose batch axis does not double is not fed samples along
the batch's dim 0, and micro-batching is refused with that reason. Where the sequence is as long as the batch is
large, every tensor agrees on dim 0 and a per-sample target makes the forward fail on part of the batch (the output
has a row per sequence, the target one per "sample" cut): the layer's batch axis still says why, so where the whole
batch runs, the batch is traced and trained whole (``BatchProbe.whole_batch``).

The same forward records whether the training forward draws random numbers (dropout, stochastic depth, LayerDrop,
attention dropout inside a fused kernel). Micro-batches draw their masks one after another, so they are not the
masks one pass over the whole batch would draw: the same distribution, not the same numbers. Under the "exact"
fidelity that refuses micro-batching (``memopt.plan.context``); the other fidelities, which already trade bitwise
equality for speed (bf16 autocast), allow it. The forward runs on a fake copy that keeps one block of each stack.

It also records which of the model's persistent buffers the training forward writes, in place or by rebinding (a
moving average, a counter, running minima of a quantization-aware layer): micro-batches would update that state once
each, from part of the batch, so micro-batching is refused under every fidelity, as for BatchNorm.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.library import Library

from memopt.blocks import hookable, persistent_buffers
from memopt.profile.fake_model import fake_copy, train_as_given
from memopt.profile.hf_compat import grouped_mm_in_any_float, real_code_paths
from memopt.profile.process_caches import caches_kept_real
from memopt.profile.recurrent_kernels import recurrent_kernels
from memopt.profile.step_failures import describe_step_failure
from memopt.profile.tracker import MemoryTracker
from memopt.step.batch import compute_loss
from memopt.step.random_draws import DrawLog
from memopt.step.side_effects import number_attributes

__all__ = ["BatchProbe", "axis_layers", "probe_batch", "random_draws_refusal", "runs_whole_batch_only",
           "state_buffers", "state_counters", "state_refusal"]

_AXIS_LAYERS = (nn.RNNBase, nn.MultiheadAttention)


@dataclass
class BatchProbe:
    """What one fake forward says about splitting the batch: ``axis_refusal`` (a layer whose batch axis is not the
    batch's dim 0, or None) and ``random_ops`` (the aten ops that drew random numbers, sorted; empty: none)."""

    axis_refusal: str | None = None
    random_ops: tuple[str, ...] = ()
    state_refusal: str | None = None  # the persistent buffers a training forward writes, or None
    # why the step runs on the whole batch only (its dim 0 is not the samples, and a part of it fails), or None
    whole_batch: str | None = None


class _ForwardLog(DrawLog):
    """Records the random ops a forward draws with (``seen``), and which of ``watched`` (tensor id -> buffer name)
    an op writes in place."""

    def __init__(self, watched: dict[int, str] | None = None) -> None:
        super().__init__()
        self.watched = watched or {}
        self.written: list[str] = []

    def _record_writes(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        schema = getattr(func, "_schema", None)
        if schema is None or not schema.is_mutable:
            return
        named = dict(zip((a.name for a in schema.arguments), args)) | kwargs
        for arg in schema.arguments:
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            t = named.get(arg.name)
            t = getattr(t, "_base", None) if isinstance(t, torch.Tensor) and id(t) not in self.watched else t
            name = self.watched.get(id(t)) if isinstance(t, torch.Tensor) else None
            if name is not None and name not in self.written:
                self.written.append(name)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.watched:
            self._record_writes(func, args, kwargs or {})
        return super().__torch_dispatch__(func, types, args, kwargs)


def random_draws_refusal(random_ops: tuple[str, ...] | list[str]) -> str | None:
    """Why micro-batches would not draw the numbers one pass over the whole batch draws, for a forward that draws
    with ``random_ops`` (None: it draws nothing)."""
    if not random_ops:
        return None
    return (f"its training forward draws random numbers ({', '.join(random_ops)}: dropout, stochastic depth or the "
            "like), and micro-batches draw them one after another, so they are not the numbers one pass over the "
            "whole batch draws (the same distribution, not the same masks)")


def state_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's persistent buffers by name, without BatchNorm's (refused on their own,
    ``memopt.techniques.micro_batching``): the state a forward may update. Non-persistent buffers are constants
    (masks, rotary frequencies) or caches rebuilt from constants."""
    return persistent_buffers(model, skip=(nn.modules.batchnorm._BatchNorm,))


def state_refusal(written: list[str]) -> str | None:
    """Why micro-batches would not be exact for a training forward that writes ``written``: persistent buffers, or
    number attributes of its modules that move at every forward (a call counter driving an annealed temperature)."""
    if not written:
        return None
    buffers = [w for w in written if not w.startswith(ATTRIBUTE)]
    attributes = [w.removeprefix(ATTRIBUTE) for w in written if w.startswith(ATTRIBUTE)]
    what = " and ".join(f"the {kind}(s) " + ", ".join(names[:3]) + (f" and {len(names) - 3} more"
                                                                     if len(names) > 3 else "")
                        for kind, names in (("buffer", buffers), ("attribute", attributes)) if names)
    return (f"its training forward updates {what} (running statistics, a moving average or a counter), "
            "so micro-batches would update them once per micro-batch, each time from part of the batch")


ATTRIBUTE = "attribute:"  # marks a module's number attribute among the buffers a forward writes


def axis_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers whose input layout names a batch axis (``batch_first``): recurrent layers and multi-head
    attention."""
    return [(name or "(root)", m) for name, m in model.named_modules() if isinstance(m, _AXIS_LAYERS)]


def _batch_axis_size(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The size of the batch axis of the layer's input as the layer reads it; None for an unbatched or packed
    input (a ``PackedSequence`` carries its own batch sizes)."""
    x = args[0] if args else kwargs.get("input", kwargs.get("query"))
    if not isinstance(x, torch.Tensor) or x.dim() < 3:
        return None
    return int(x.shape[0] if getattr(module, "batch_first", False) else x.shape[1])


@dataclass
class _Forward:
    """What one fake training forward saw: the batch-axis size of each axis layer it reached, the random ops drawn,
    the persistent buffers written, and the error that stopped it (None: it ran to its loss)."""

    seen: dict[str, int]
    draws: set[str]
    written: list[str]
    error: Exception | None = None
    single_draws: set[str] = field(default_factory=set)  # random ops that drew one number (``DrawLog.single``)


def _forward(model: nn.Module, batch_factory: Any, loss_fn: Any, samples: int) -> _Forward:
    """One training forward (and loss) of a fake copy at ``samples`` samples. A forward that fails still says what
    its layers saw before it failed: a sequence-first batch whose length equals its batch size reaches its recurrent
    layer at any number of samples, and fails only where a per-sample target meets the output."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        clone = fake_copy(model, mode, "cpu", keep_blocks=1)
    except Exception as exc:  # no copy, no forward: the trace reports what it can of such a model
        return _Forward({}, set(), [], exc)
    train_as_given(clone, model)
    seen: dict[str, int] = {}
    ran: set[str] = set()
    hooks = []
    for name, layer in axis_layers(clone):
        if not hookable(layer):
            continue

        def record(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], name: str = name) -> None:
            ran.add(name)
            size = _batch_axis_size(m, args, kwargs)
            if size is not None:
                seen.setdefault(name, size)
        hooks.append(layer.register_forward_pre_hook(record, with_kwargs=True))
    before = state_buffers(clone)
    draws = _ForwardLog({id(b): name for name, b in before.items()})
    error: Exception | None = None
    written_attrs: list[str] = []
    try:
        with contextlib.ExitStack() as stack:
            if any(isinstance(m, nn.RNNBase) for m in clone.modules()):
                # the CPU unrolls a recurrent layer into a few ops per time step (a GRU over 2,048 steps: 80 s of
                # fake forward); the trace's one fused kernel answers the same question in one op
                lib = Library("aten", "IMPL")
                stack.callback(lib._destroy)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # "overriding a previously registered kernel" is what we mean
                    stack.enter_context(recurrent_kernels(lib))
            # the tracker answers the boolean checks models make on masks (fake tensors have no values)
            stack.enter_context(caches_kept_real(model))
            for ctx in (mode, real_code_paths(), grouped_mm_in_any_float(), torch.no_grad(),
                        MemoryTracker("cpu", record=False)):
                stack.enter_context(ctx)
            batch = batch_factory(samples, "cpu")  # outside the op log: a factory may draw random inputs
            plain = state_counters(clone)
            with draws:
                compute_loss(clone, batch, loss_fn)
            moved = _moved(plain, state_counters(clone))
            if moved:  # a counter moves again at the next forward; a cache filled once (a rotary length) does not
                plain = state_counters(clone)
                compute_loss(clone, batch, loss_fn)
                written_attrs = [f"{ATTRIBUTE}{k}" for k in _moved(plain, state_counters(clone)) if k in moved]
    except Exception as exc:  # the model's own step failing is a finding here, reported by the caller
        error = exc
    finally:
        for h in hooks:
            h.remove()
    layers = dict(axis_layers(clone))
    for name in sorted(ran):
        layer = layers[name]
        # the fused kernel draws the dropout between stacked recurrent layers inside itself, as cuDNN does
        if isinstance(layer, nn.RNNBase) and layer.dropout > 0 and layer.num_layers > 1:
            draws.seen.add(f"{type(layer).__name__.lower()}(dropout={layer.dropout:g})")
    after = state_buffers(clone)
    rebound = [name for name, b in before.items() if after.get(name) is not b and name not in draws.written]
    return _Forward(seen, draws.seen, draws.written + rebound + written_attrs, error, draws.single)


def state_counters(model: nn.Module) -> dict[str, float]:
    """Every module's public number attributes (``self.calls``, ``self.temperature``), by qualified name: state a
    forward may keep outside its buffers."""
    return {f"{name}.{attr}" if name else attr: value for name, _, attr, value in number_attributes(model)}


def _moved(before: dict[str, float], after: dict[str, float]) -> list[str]:
    return [k for k, v in after.items() if k in before and before[k] != v]


def _axis_refusal(model: nn.Module, one: dict[str, int], two: dict[str, int]) -> str | None:
    layers = dict(axis_layers(model))
    for name in one:
        if name in two and name in layers and two[name] != 2 * one[name]:
            layer = layers[name]
            axis = 0 if getattr(layer, "batch_first", False) else 1
            return (f"its {type(layer).__name__} {name} (batch_first={getattr(layer, 'batch_first', False)}) reads "
                    f"its batch from dim {axis} of its input, which holds {one[name]} rows for 1 sample and "
                    f"{two[name]} for 2: the batch's dim 0 is not the samples (a sequence-first batch?), so a "
                    "micro-batch would be a slice of every sequence; pass batches with the samples along dim 0 "
                    "(batch_first=True) to allow micro-batching")
    return None


def _per_sample_draws(one: _Forward, two: _Forward | None, model: nn.Module, batch_factory: Any,
                      loss_fn: Any) -> set[str]:
    """The random ops that drew one number for 1 sample but more for 2: a draw per sample (drop path's
    ``torch.rand(B, 1)``), which micro-batches draw apart. A forward that draws no single number is not run again,
    and a per-step decision (LayerDrop's ``torch.rand(())``) draws one number at any batch size."""
    if not one.single_draws:
        return set()
    if two is None:
        two = _forward(model, batch_factory, loss_fn, 2)
    return two.draws & one.single_draws


def runs_whole_batch_only(model: nn.Module, batch_factory: Any, loss_fn: Any, samples: int) -> bool:
    """Whether the model's forward runs on the whole batch of ``samples`` but not on one sample of it: its batch's
    first dimension is not independent samples (a whole graph: its nodes' features and their adjacency)."""
    if samples < 2 or _forward(model, batch_factory, loss_fn, 1).error is None:
        return False
    return _forward(model, batch_factory, loss_fn, samples).error is None


def probe_batch(model: nn.Module, batch_factory: Any, loss_fn: Any = None,
                samples: int | None = None) -> BatchProbe | None:
    """What splitting the batch along dim 0 does to ``model``'s training forward; None when the probe could not
    run (the trace itself reports a model that cannot). ``batch_factory(b, device)`` makes a batch of ``b``
    samples; ``samples`` is the whole batch's.

    A forward that fails on one sample while a layer that names its batch axis finds that axis the same size at 1
    and 2 samples is fed a batch whose dim 0 is not the samples (time steps, with a per-sample target that only
    the whole batch matches): where the whole batch of ``samples`` runs, ``whole_batch`` says so, and the profile
    traces and trains the batch whole."""
    one = _forward(model, batch_factory, loss_fn, 1)
    two = _forward(model, batch_factory, loss_fn, 2) if one.seen else None
    if one.error is None and (two is None or two.error is None):
        per_sample = _per_sample_draws(one, two, model, batch_factory, loss_fn)
        return BatchProbe(axis_refusal=_axis_refusal(model, one.seen, two.seen if two is not None else {}),
                          random_ops=tuple(sorted(one.draws | per_sample)), state_refusal=state_refusal(one.written))
    if one.error is None or two is None or samples is None or samples < 2:
        return None
    axis = _axis_refusal(model, one.seen, two.seen)
    whole = _forward(model, batch_factory, loss_fn, samples) if axis is not None else None
    if whole is None or whole.error is not None:
        return None
    return BatchProbe(axis_refusal=axis, random_ops=tuple(sorted(whole.draws)),
                      state_refusal=state_refusal(whole.written),
                      whole_batch=(f"its step runs on the whole batch of {samples} only (on 1 sample: "
                                   f"{describe_step_failure(one.error)})"))
