"""The batch and loss contract: what a batch may be, how it is split, moved and counted, how the loss is made.

Every path that runs a training step (``memopt.wrap``, the profile's fake-tensor trace of the same step, the
guard's retry of a batch, the distributed steps, the Hugging Face Trainer path) goes through this module, so they
all accept the same batches.

**A batch** is a tensor, or a tuple, list, dict or dataclass of batches (nested to any depth; a namedtuple, a
``BatchEncoding`` and a dataclass keep their types).
Every tensor with at least one dimension holds the samples along dim 0, all the same number of them; 0-d tensors
and non-tensor leaves (ints, strings, ``None``) are passed unchanged to every micro-batch. A batch whose tensors
disagree on dim 0 (a graph: node features beside a ``(2, edges)`` edge index) is ``indivisible``: one sample,
trained whole.

**The loss of one micro-batch** (``compute_loss``), first rule that applies:

1. ``training_step=(model, batch) -> loss`` (as a Lightning ``training_step``): called with the model and the
   micro-batch, on the device, under the plan's autocast.
2. a dict batch: ``model(**batch)`` with only the keys ``forward`` accepts (all of them when it takes
   ``**kwargs``): a target kept beside the inputs for ``loss_fn`` is not passed to the model; ``model(batch)``
   when ``forward`` takes the dict itself (one parameter, named after none of the keys).
3. a tensor or dataclass batch: ``model(batch)``.
4. a tuple/list batch: with ``loss_fn``, ``(inputs..., target)``: ``model(*batch[:-1])`` (a one-element batch:
   ``model(batch[0])``); without ``loss_fn``, ``model(*batch)`` (a model that takes the target and returns the loss).

then ``loss_fn(output, batch) -> loss`` when given, else the output's ``.loss`` (``output["loss"]``), the
output itself when it is a scalar tensor, or the one scalar tensor of a tuple output (``(logits, loss)``).

**Exact accumulation.** Micro-batch ``i`` is weighted by ``n_i / N``. ``n_i`` counts the tokens that carry loss,
``labels != -100``, when the batch has per-token integer labels (dict key ``labels``, or the last element of a
tuple/list batch, at least 2-D); otherwise its samples (dim 0). For a loss that is the mean over those items
(``F.cross_entropy``'s default ``ignore_index=-100`` and ``reduction="mean"``, Hugging Face's losses, an MSE mean
over samples) the accumulated gradient then equals the gradient of the whole batch's loss. A loss summed over its
items is accumulated unweighted instead (``memopt.step.loss_reduction`` measures which, or the user says).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from memopt.models.hf_task import hf_forward_kwargs, is_hf_model, peft_unwrapped

__all__ = ["TRAINED_WHOLE", "TrainingStep", "as_loss", "batch_size", "check_batch", "compute_loss", "count_loss_items",
           "default_loss", "forward_kwargs", "indivisible", "is_batch", "leaves", "like", "scalar_loss", "shard",
           "split", "structure", "tensors", "to_device", "token_labels", "tree_map"]

IGNORE_INDEX = -100


class TrainingStep:
    """A user's ``(model, batch) -> loss``, carried where a ``loss_fn(output, batch)`` would be (so every path
    that passes ``loss_fn`` along passes it too)."""

    def __init__(self, fn: Callable[[nn.Module, Any], torch.Tensor]) -> None:
        if not callable(fn):
            raise ValueError(f"training_step must be a callable (model, batch) -> loss, got {type(fn).__name__}")
        self.fn = fn

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return scalar_loss(self.fn(model, batch), "training_step")


def as_loss(loss_fn: Any, training_step: Any) -> Any:
    """The one loss callable every path carries: ``loss_fn``, or ``training_step`` wrapped (not both)."""
    if training_step is None:
        first = _first_parameter(loss_fn) if loss_fn is not None and not isinstance(loss_fn, TrainingStep) else None
        if first in _MODEL_NAMES:
            raise ValueError("loss_fn is called as loss_fn(output, batch), but its first parameter is named "
                             f"{first!r}: a function that calls the model itself is a training_step; pass "
                             "training_step=(model, batch) -> loss instead")
        return loss_fn
    if loss_fn is not None:
        raise ValueError("pass loss_fn=(output, batch) -> loss or training_step=(model, batch) -> loss, not both: "
                         "a training_step calls the model and makes the loss itself")
    return training_step if isinstance(training_step, TrainingStep) else TrainingStep(training_step)


# the first parameter names that say a function takes the model, not its output
_MODEL_NAMES = {"model", "module", "net", "network"}


def _first_parameter(fn: Any) -> str | None:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: nothing to read
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return positional[0].name if positional else None


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def _is_dataclass_batch(x: Any) -> bool:
    """A dataclass instance holding the batch's tensors in its fields (``Batch(x=..., y=...)``)."""
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def _fields(batch: Any) -> list[str]:
    """A dataclass batch's fields that its constructor takes (the others are derived from them)."""
    return [f.name for f in dataclasses.fields(batch) if f.init]


def is_batch(x: Any) -> bool:
    """Whether ``x`` is a structure this module trains on: a tensor, mapping, list, tuple or dataclass instance."""
    return isinstance(x, (torch.Tensor, Mapping, list, tuple)) or _is_dataclass_batch(x)


def tree_map(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """``batch`` with every tensor leaf replaced by ``fn(leaf)``; containers keep their types."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        items = {k: tree_map(fn, v) for k, v in batch.items()}
        try:
            return type(batch)(items)  # a BatchEncoding or OrderedDict stays one
        except TypeError:
            return items
    if _is_namedtuple(batch):
        return type(batch)(*(tree_map(fn, v) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(tree_map(fn, v) for v in batch)
    if _is_dataclass_batch(batch):
        return dataclasses.replace(batch, **{k: tree_map(fn, getattr(batch, k)) for k in _fields(batch)})
    return batch


def leaves(batch: Any, path: str = "") -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor: ``x``, ``[0]``, ``inputs[1].mask``."""
    if isinstance(batch, torch.Tensor):
        return [(path or "batch", batch)]
    if isinstance(batch, Mapping):
        return [leaf for k, v in batch.items() for leaf in leaves(v, f"{path}.{k}" if path else str(k))]
    if isinstance(batch, (list, tuple)):
        return [leaf for i, v in enumerate(batch) for leaf in leaves(v, f"{path}[{i}]")]
    if _is_dataclass_batch(batch):
        return [leaf for k in _fields(batch) for leaf in leaves(getattr(batch, k), f"{path}.{k}" if path else k)]
    return []


def tensors(batch: Any) -> list[torch.Tensor]:
    """Every tensor in the batch."""
    return [t for _, t in leaves(batch)]


def _sizes(batch: Any) -> dict[int, list[str]]:
    """Dim 0 of every tensor with a dimension -> the tensors' paths (dense tensors only)."""
    sizes: dict[int, list[str]] = {}
    for path, t in leaves(batch):
        if t.layout != torch.strided:  # it cannot be cut into micro-batches by rows, nor traced as bytes
            raise ValueError(f"the batch's {path} is a {str(t.layout).removeprefix('torch.')} tensor: memopt plans "
                             "and splits dense (strided) tensors only; pass it dense (.to_dense())")
        if t.dim() > 0:
            sizes.setdefault(int(t.shape[0]), []).append(path)
    if not sizes:
        kinds = type(batch).__name__
        raise ValueError(f"the batch ({kinds}) holds no tensor with a batch dimension: pass a tensor, or a tuple, "
                         "list or dict of tensors whose first dimension is the samples")
    if len(sizes) > 1 and any("cu_seq_lens" in path for paths in sizes.values() for path in paths):
        # planned whole, a packed batch would lose the rows the user's batch size counts (a Trainer's collator
        # packs per_device_train_batch_size rows into one)
        listed = "; ".join(f"{n} in {', '.join(paths[:3])}" for n, paths in sorted(sizes.items()))
        raise ValueError(f"the batch is packed without padding ({listed}): its sequences are joined in one row "
                         "and cu_seq_lens marks where each starts, so it has no samples along dim 0 to plan "
                         "micro-batches by; memopt plans batches of padded rows: train with padding_free=False "
                         "(TRL: packing=False, or packing_strategy='wrapped')")
    return sizes


#: what happens to an ``indivisible`` batch, and how to make it divisible (the plan's note after the reason)
TRAINED_WHOLE = ("so it has no samples to split into micro-batches and is trained whole, as one sample; to let memopt "
                 "split it, give every tensor the samples along dim 0 (a tensor that is not per sample, such as class "
                 "weights, belongs in your loss_fn or training_step; a sequence-first tensor goes in batch-first and "
                 "is transposed inside training_step)")


def indivisible(batch: Any) -> str | None:
    """Why ``batch`` cannot be split along dim 0, or None. Its tensors disagree on dim 0 (a graph's node features
    beside its ``(2, edges)`` edge index, a sequence-first input beside per-sample targets): no dim 0 holds the
    samples, so the batch is one indivisible sample, trained whole (one micro-batch, one rank's batch)."""
    sizes = _sizes(batch)
    if len(sizes) == 1:
        return None
    listed = "; ".join(f"{n} in {', '.join(paths[:3])}" for n, paths in sorted(sizes.items()))
    return f"the batch's tensors disagree on dim 0 ({listed})"


def batch_size(batch: Any) -> int:
    """The number of samples: dim 0 of every tensor with a dimension; 1 for an ``indivisible`` batch."""
    sizes = _sizes(batch)
    return next(iter(sizes)) if len(sizes) == 1 else 1


def _slice(batch: Any, lo: int, hi: int) -> Any:
    return tree_map(lambda t: t[lo:hi] if t.dim() > 0 else t, batch)


def split(batch: Any, micro_batch_size: int) -> list[Any]:
    """Micro-batches of ``micro_batch_size`` samples (the last one may be smaller), same structure as ``batch``."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if indivisible(batch):
        return [batch]
    total = batch_size(batch)
    return [_slice(batch, lo, lo + micro_batch_size) for lo in range(0, total, micro_batch_size)]


def shard(batch: Any, rank: int, world_size: int) -> Any:
    """Rank ``rank``'s contiguous share of a global batch (its samples must divide by ``world_size``)."""
    why = indivisible(batch) if world_size > 1 else None
    if why:
        raise ValueError(f"{why}: it cannot be shared over {world_size} ranks; give every tensor "
                         "the samples along dim 0, or train on one GPU")
    total = batch_size(batch)
    if total % world_size:
        raise ValueError(f"the global batch of {total} samples does not split evenly over {world_size} ranks")
    per = total // world_size
    return _slice(batch, rank * per, (rank + 1) * per)


def to_device(batch: Any, device: torch.device | str | None, *, pin: bool = False) -> Any:
    """The batch on ``device`` (tensors already there are kept). ``pin``: host tensors bound for a GPU are pinned
    first, so their copies do not block the host."""
    if device is None:
        return batch
    device = torch.device(device)

    def move(t: torch.Tensor) -> torch.Tensor:
        if t.device == device:
            return t
        if pin and device.type == "cuda" and t.device.type == "cpu" and not _is_fake(t):
            t = t.pin_memory()
        return t.to(device, non_blocking=True)

    return tree_map(move, batch)


def _is_fake(t: Any) -> bool:
    return type(t).__name__ == "FakeTensor"


def labels_of(batch: Any) -> Any:
    """The batch's labels: dict key ``labels``, or the last element of a tuple/list of 2+ elements; else None."""
    if isinstance(batch, Mapping):
        return batch.get("labels")
    if isinstance(batch, (list, tuple)) and not _is_namedtuple(batch) and len(batch) >= 2:
        return batch[-1]
    if _is_namedtuple(batch) or _is_dataclass_batch(batch):
        return getattr(batch, "labels", None)
    return None


def token_labels(batch: Any, causal: bool = False) -> torch.Tensor | None:
    """Integer labels whose ``-100`` entries carry no loss (``F.cross_entropy``'s default ``ignore_index``): per
    token (shifted by one for a causal LM: its first position carries none), or one per sample, where a sample
    labelled -100 is left out of the mean as well. None for other labels (floating, boolean) or none."""
    labels = labels_of(batch)
    if not isinstance(labels, torch.Tensor) or labels.dim() < (2 if causal else 1):
        return None
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        return None  # regression / soft targets: weighted by samples
    return labels[..., 1:] if causal else labels


def count_loss_items(batch: Any, *, causal: bool = False) -> int:
    """The labels that carry loss (labels != -100) where the batch has integer labels, else its samples."""
    labels = token_labels(batch, causal)
    if labels is not None:
        if _is_fake(labels):
            return labels.numel()  # a fake batch has no values: every label counts
        return int((labels != IGNORE_INDEX).sum())
    return batch_size(batch)


def count_pending(batch: Any, *, causal: bool = False) -> int | torch.Tensor:
    """``count_loss_items``, left on the device as a tensor when the labels are there (read back in one sync)."""
    labels = token_labels(batch, causal)
    if labels is not None and labels.device.type != "cpu" and not _is_fake(labels):
        return (labels != IGNORE_INDEX).sum()
    return count_loss_items(batch, causal=causal)


def _accepts(model: nn.Module) -> set[str] | None:
    """The keyword names ``model.forward`` takes; None when it takes any (``**kwargs``). A Hugging Face model's
    ``**kwargs`` are its ``TransformersKwargs`` (flash-attention lengths, ``num_items_in_batch``, ...): those and the
    named parameters are what it takes, so a target kept beside its inputs is not sent down its layers."""
    forward = model.forward
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return None
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if any(p.kind is p.VAR_KEYWORD for p in params):
        if not is_hf_model(model):
            return None
        names |= hf_forward_kwargs()
    return names


def forward_kwargs(model: nn.Module, batch: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of a dict batch that ``model.forward`` accepts (all of them when it takes ``**kwargs``)."""
    names = _accepts(_unwrapped(model))
    if names is None:
        return dict(batch)
    kept = {k: v for k, v in batch.items() if k in names}
    if not kept:
        raise ValueError(f"none of the batch's keys {sorted(batch)} is a parameter of {type(model).__name__}."
                         f"forward ({', '.join(sorted(names)) or 'no keyword parameters'}): name the keys after "
                         "forward's parameters, or pass training_step=(model, batch) -> loss to call it yourself")
    return kept


def takes_the_whole_dict(model: nn.Module, batch: Mapping[str, Any]) -> bool:
    """Whether ``forward`` takes the dict itself (``def forward(self, batch)``, as many Lightning-style modules do):
    one required parameter, no ``**kwargs``, and none of the batch's keys among its parameters' names."""
    try:
        params = list(inspect.signature(_unwrapped(model).forward).parameters.values())
    except (TypeError, ValueError):
        return False
    if any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in params) or any(p.name in batch for p in params):
        return False
    required = [p for p in params if p.default is p.empty]
    return len(required) == 1 and required[0].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                       inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _unwrapped(model: nn.Module) -> nn.Module:
    """The user's module inside a wrapper that forwards ``*args, **kwargs`` to it (DDP's and DeepSpeed's
    ``module``, peft's base model), whose signature says nothing."""
    inner = model
    for _ in range(4):
        peft_inner = peft_unwrapped(inner)  # a PeftModel: its forward(*args, **kwargs) calls the base model
        candidate = peft_inner if peft_inner is not inner else getattr(inner, "module", None)
        if not isinstance(candidate, nn.Module) or candidate is inner:
            break
        try:
            params = inspect.signature(type(inner).forward).parameters.values()
        except (TypeError, ValueError):
            break
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
        inner = candidate
    return inner


def default_loss(output: Any, batch: Any) -> torch.Tensor:
    """The output's ``.loss`` (or ``["loss"]``), the output itself when it is a scalar tensor, or the one scalar
    tensor of a tuple output."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if loss is None and isinstance(output, torch.Tensor) and output.dim() == 0:
        loss = output
    if loss is None and isinstance(output, (tuple, list)):
        # (logits, loss) as nanoGPT-style models return it, (loss, logits, ...) as return_dict=False does: the one
        # number among the outputs is the loss
        scalars = [t for t in output if isinstance(t, torch.Tensor) and t.dim() == 0]
        loss = scalars[0] if len(scalars) == 1 else None
    if loss is None and isinstance(output, torch.Tensor):
        # a tensor of one element may be a loss kept 1-d or one sample's prediction: not guessed
        hint = " (for a loss kept as shape (1,): loss_fn=lambda out, b: out)" if output.numel() == 1 else ""
        raise ValueError(f"the model returned a tensor of shape {tuple(output.shape)}, not a loss (a 0-d tensor): "
                         f"pass loss_fn=(output, batch) -> loss{hint} (e.g. lambda out, b: F.cross_entropy(out, "
                         "b[1]) for an (x, y) batch) or training_step=(model, batch) -> loss to memopt.wrap")
    if loss is None:
        raise ValueError(f"the model returned a {type(output).__name__} without a loss: pass "
                         "loss_fn=(output, batch) -> loss (e.g. lambda out, b: F.cross_entropy(out, b[1]) for an "
                         "(x, y) batch) or training_step=(model, batch) -> loss to memopt.wrap, or include labels "
                         "in a Hugging Face model's batch")
    return loss


def compute_loss(model: nn.Module, batch: Any, loss_fn: Any = None) -> torch.Tensor:
    """The loss of one micro-batch under the contract in this module's docstring."""
    if isinstance(loss_fn, TrainingStep):
        return loss_fn(model, batch)
    if isinstance(batch, Mapping):
        output = model(batch) if takes_the_whole_dict(model, batch) else model(**forward_kwargs(model, batch))
    elif isinstance(batch, torch.Tensor) or _is_dataclass_batch(batch):
        output = model(batch)
    elif isinstance(batch, (list, tuple)):
        if not batch:
            raise ValueError("the batch is an empty tuple/list: pass the model's inputs (and the target)")
        inputs = batch[:-1] if loss_fn is not None and len(batch) >= 2 else batch
        _check_takes(model, batch, len(inputs))
        output = model(*inputs)
    else:
        raise _not_a_batch(batch)
    if loss_fn is None:
        return default_loss(output, batch)
    try:
        value = loss_fn(output, batch)
    except TypeError as exc:
        if f"'{type(output).__name__}' object is not callable" not in str(exc):
            raise
        raise ValueError(f"loss_fn(output, batch) called its first argument, the model's output (a "
                         f"{type(output).__name__}): a function that calls the model itself is passed as "
                         "training_step=(model, batch) -> loss") from exc
    return scalar_loss(value, "loss_fn")


def scalar_loss(value: Any, source: str) -> torch.Tensor:
    """The loss in what ``source`` (the user's ``training_step`` or ``loss_fn``) returned: a scalar tensor, or a
    dict with a ``"loss"`` entry (a Lightning ``training_step``'s ``{"loss": ..., "log": ...}``), or an object with
    a ``.loss``; anything else is a one-line error, before a backward would fail on it."""
    loss = value
    if isinstance(value, Mapping):
        loss = value.get("loss")
    elif not isinstance(value, torch.Tensor) and getattr(value, "loss", None) is not None:
        loss = value.loss
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss.reshape(()) if loss.dim() else loss
    if isinstance(loss, torch.Tensor):
        raise ValueError(f"{source} returned a loss of shape {tuple(loss.shape)}, not one number: reduce it over the "
                         "samples (e.g. .mean(), or reduction='mean' in the loss function)")
    what = ("a dict without a 'loss' entry (keys: " + ", ".join(map(str, list(value)[:5])) + ")"
            if isinstance(value, Mapping) else f"a {type(value).__name__}")
    raise ValueError(f"{source} returned {what}: return the loss as a scalar tensor, or a dict with the loss under "
                     "'loss' (as a Lightning training_step may)")


def _looks_like_rows(batch: Any) -> bool:
    """A list of dataset rows not yet collated: two or more dicts with the same keys."""
    return (isinstance(batch, (list, tuple)) and len(batch) >= 2 and all(isinstance(b, Mapping) for b in batch)
            and len({tuple(b) for b in batch}) == 1)


def _check_takes(model: nn.Module, batch: list[Any] | tuple[Any, ...], count: int) -> None:
    """A one-line error when a tuple batch's first ``count`` elements (all but the target, under a ``loss_fn``) do
    not fit ``forward``."""
    name = type(_unwrapped(model)).__name__
    target_held_back = count < len(batch)
    try:
        inspect.signature(_unwrapped(model).forward).bind(*range(count))
    except TypeError:
        if _looks_like_rows(batch):
            raise ValueError(f"the batch is a list of {len(batch)} dicts with the same keys, which {name}.forward "
                             "does not take: dataset rows not yet collated? memopt takes one collated batch (every "
                             "tensor with the samples along dim 0), e.g. torch.utils.data.default_collate(rows) or "
                             "next(iter(loader))") from None
        if target_held_back:
            raise ValueError(f"{name}.forward does not take the {count} input(s) of the (inputs..., target) batch: "
                             "with loss_fn the last element is the target and is not passed to the model; to pass it "
                             "too, give training_step=(model, batch) -> loss, or a dict batch whose keys are "
                             "forward's parameters") from None
        raise ValueError(f"{name}.forward does not take the batch's {count} elements: for an (inputs..., target) "
                         "batch pass loss_fn=(output, batch) -> loss (the target is then not passed to the model) "
                         "or training_step=(model, batch) -> loss") from None
    except ValueError:  # no signature to read: let the call say
        return


def check_batch(batch: Any) -> int:
    """The batch's sample count, or a one-line ValueError saying what a batch may be."""
    if not is_batch(batch):
        raise _not_a_batch(batch)
    return batch_size(batch)


def _not_a_batch(batch: Any) -> ValueError:
    return ValueError(f"cannot train on a batch of type {type(batch).__name__}: pass a tensor, or a tuple, list, "
                      "dict or dataclass of tensors (samples along dim 0)")


def structure(batch: Any) -> Any:
    """A JSON-able description of the batch: its containers, and each tensor's shape and dtype (the profile's
    cache key and the recipe for fake batches of another size)."""
    if isinstance(batch, torch.Tensor):
        return {"shape": list(batch.shape), "dtype": str(batch.dtype).replace("torch.", "")}
    if isinstance(batch, Mapping):
        return {"dict": {str(k): structure(v) for k, v in batch.items()}}
    if isinstance(batch, (list, tuple)):
        return {"list" if isinstance(batch, list) else "tuple": [structure(v) for v in batch]}
    if _is_dataclass_batch(batch):
        return {"dataclass": f"{type(batch).__module__}.{type(batch).__qualname__}",
                "fields": {k: structure(getattr(batch, k)) for k in _fields(batch)}}
    return {"value": repr(batch)}


def integer_maxima(batch: Any) -> list[int | None]:
    """For each tensor of the batch (``leaves`` order), the largest value of an integer one that holds values, else
    None: what ``like`` fills it with."""
    def top(t: torch.Tensor) -> int | None:
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool or t.numel() == 0:
            return None
        if t.device.type == "meta" or _is_fake(t):
            return None
        return int(t.max())

    return [top(t) for t in tensors(batch)]


def like(batch: Any, size: int | None, device: str | torch.device, fill: list[int | None] | None = None) -> Any:
    """A batch of ``size`` samples (None: the whole of ``batch``, every shape kept) with ``batch``'s structure,
    dtypes and per-sample shapes, created on ``device``: random floats; each integer tensor filled with its ``fill``
    value (``integer_maxima`` of the real batch: valid class ids and never -100, so every label carries loss, and the
    longest of a batch's lengths, so a model that trims its padding to ``lengths.max()`` is traced at the batch's
    length), or zeros without one; booleans false."""
    fills = iter(fill or [])

    def make(t: torch.Tensor) -> torch.Tensor:
        shape = tuple(t.shape) if size is None else (size, *t.shape[1:]) if t.dim() > 0 else ()
        value = next(fills, None)
        if t.is_floating_point():
            return torch.randn(shape, device=device).to(t.dtype)
        if value is not None:
            return torch.full(shape, value, dtype=t.dtype, device=device)
        return torch.zeros(shape, dtype=t.dtype, device=device)

    return tree_map(make, batch)
