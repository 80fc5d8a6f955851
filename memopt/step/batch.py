"""The batch and loss contract: what a batch may be, how it is split, moved and counted, how the loss is made.

Every path that runs a training step (``memopt.wrap``, the profile's fake-tensor trace of the same step, the
guard's retry of a batch, the distributed steps, the Hugging Face Trainer path) goes through this module, so they
all accept the same batches.

This module holds what a step does with a batch: splits it into micro-batches or rank shares, moves it to the
device, counts its loss items, makes its loss. What that stands on sits beside it, one concern each: walking a
batch's containers (``memopt.step.batch_tree``), counting its samples and telling an indivisible one
(``memopt.step.batch_samples``), fitting it to ``forward``'s signature (``memopt.step.forward_signature``), and
batches made like it for the profile's traces at other sizes (``memopt.step.batch_like``).

**A batch** is a tensor, or a tuple, list, dict or dataclass of batches (nested to any depth; a namedtuple, a
``BatchEncoding`` and a dataclass keep their types). Every tensor with at least one dimension holds the samples
along dim 0, all the same number of them; 0-d tensors and non-tensor leaves (ints, strings, ``None``) are passed
unchanged to every micro-batch; a list of dicts inside the batch as long as its samples (a detection batch's
targets) is one record per sample, split by records. A batch whose tensors disagree on dim 0 (a graph: node features
beside a ``(2, edges)`` edge index) is ``indivisible``: one sample, trained whole.

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

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from memopt.step.batch_samples import batch_size, indivisible, record_ids
from memopt.step.batch_tree import is_batch, is_dataclass_batch, is_fake, is_namedtuple, tree_map
from memopt.step.forward_signature import check_takes, forward_kwargs, takes_the_whole_dict

__all__ = ["IGNORE_INDEX", "TrainingStep", "as_loss", "check_batch", "compute_loss", "count_loss_items",
           "count_pending", "default_loss", "labels_of", "read_back", "scalar_loss", "shard", "split", "to_device",
           "token_labels"]

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


def _slice(batch: Any, lo: int, hi: int) -> Any:
    """Samples ``lo`` to ``hi``: those rows of every tensor, those records of a list of per-sample records."""
    return tree_map(lambda t: t[lo:hi] if t.dim() > 0 else t, batch, records=lambda r: r[lo:hi],
                    record_ids=record_ids(batch))


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
        if pin and device.type == "cuda" and t.device.type == "cpu" and not is_fake(t):
            t = t.pin_memory()
        return t.to(device, non_blocking=True)

    return tree_map(move, batch)


def labels_of(batch: Any) -> Any:
    """The batch's labels: dict key ``labels``, or the last element of a tuple/list of 2+ elements; else None."""
    if isinstance(batch, Mapping):
        return batch.get("labels")
    if isinstance(batch, (list, tuple)) and not is_namedtuple(batch) and len(batch) >= 2:
        return batch[-1]
    if is_namedtuple(batch) or is_dataclass_batch(batch):
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
        if is_fake(labels):
            return labels.numel()  # a fake batch has no values: every label counts
        return int((labels != IGNORE_INDEX).sum())
    return batch_size(batch)


def count_pending(batch: Any, *, causal: bool = False) -> int | torch.Tensor:
    """``count_loss_items``, left on the device as a tensor when the labels are there (read back in one sync)."""
    labels = token_labels(batch, causal)
    if labels is not None and labels.device.type != "cpu" and not is_fake(labels):
        return (labels != IGNORE_INDEX).sum()
    return count_loss_items(batch, causal=causal)


def read_back(pending: list[int | torch.Tensor]) -> list[int]:
    """The values of ``pending`` as ints, with one device-to-host copy per device (one on a single GPU): a sync per
    value would drain the GPU's queue before each micro-batch's forward. ``pending``: ``count_pending``'s values,
    or any other per-micro-batch count left on the device."""
    out: list[Any] = list(pending)
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(pending):
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(i)
    for idx in by_device.values():
        for i, v in zip(idx, torch.stack([pending[i] for i in idx]).tolist()):
            out[i] = v
    return [int(v) for v in out]


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
    elif isinstance(batch, torch.Tensor) or is_dataclass_batch(batch):
        output = model(batch)
    elif isinstance(batch, (list, tuple)):
        if not batch:
            raise ValueError("the batch is an empty tuple/list: pass the model's inputs (and the target)")
        inputs = batch[:-1] if loss_fn is not None and len(batch) >= 2 else batch
        check_takes(model, batch, len(inputs))
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


def check_batch(batch: Any) -> int:
    """The batch's sample count, or a one-line ValueError saying what a batch may be."""
    if not is_batch(batch):
        raise _not_a_batch(batch)
    n = batch_size(batch)
    if n == 0:
        raise ValueError(EMPTY_BATCH)
    return n


EMPTY_BATCH = ("the batch holds no samples (its tensors have 0 rows along dim 0): pass at least one sample, "
               "samples along dim 0")


def _not_a_batch(batch: Any) -> ValueError:
    return ValueError(f"cannot train on a batch of type {type(batch).__name__}: pass a tensor, or a tuple, list, "
                      "dict or dataclass of tensors (samples along dim 0)")
