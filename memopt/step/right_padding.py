"""Trailing padding that a micro-batch carries only because the whole batch was padded to its longest row.

A collator pads the global batch to its longest row. Split into micro-batches, each one keeps those columns even
where none of its own rows reaches them, while a script that accumulates gradients itself (``per_device=micro``)
has its collator pad each micro-batch only to its own longest row: memopt would compute padding the hand-written
configuration never does. The columns that are padding in every row of a micro-batch (``attention_mask == 0``,
and no loss token in them: ``labels == -100``) are cut off before its forward, where that is exact for the model.

Exactness is measured, not assumed (:func:`padding_invariant`): most models mask padded keys out of attention and
never read a padded position into a real one, but a convolution over the sequence (ConvBERT), a mean over all
positions, or a classifier that reads the last column does. The check appends right padding to a real
micro-batch and compares the losses: adding padding and removing it are the same question, and appending needs no
knowledge of where the batch's padding is. It appends several counts of columns, and as many as the batch is wide:
a strided convolution sees some counts and not others, and long-context rotary factors switch past a length.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memopt.step.batch import IGNORE_INDEX, count_pending, read_back
from memopt.step.batch_tree import is_fake, rebuilt
from memopt.step.side_effects import side_effects_undone

__all__ = ["LABEL_KEYS", "PaddingCut", "drop_trailing", "model_loss", "padding_invariant", "pending_trailing_padding",
           "trailing_padding", "trim_right"]

# per-token targets whose padded columns must carry no loss (shift_labels: labels already shifted by one)
LABEL_KEYS = ("labels", "shift_labels")
LossOf = Callable[[nn.Module, Mapping], "torch.Tensor | None"]
Verdict = Callable[[Any], tuple[bool, str]]


def _mask(batch: Any) -> torch.Tensor | None:
    """The batch's 2-D ``attention_mask`` (B, T), or None: only then do columns mean sequence positions."""
    if not isinstance(batch, Mapping):
        return None
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not is_fake(mask):
        return mask
    return None


def _per_token(t: Any, shape: tuple[int, int]) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() >= 2 and tuple(t.shape[:2]) == shape


def pending_trailing_padding(batch: Any) -> int | torch.Tensor:
    """How many trailing columns of ``batch`` are padding in every row and carry no loss token: a 0-d tensor on the
    batch's device (read back with the others in one sync: :func:`read_back`), or 0 when nothing can be said. At
    least one column is kept, so that no forward sees an empty sequence."""
    mask = _mask(batch)
    if mask is None or mask.shape[1] < 2:
        return 0
    shape = (mask.shape[0], mask.shape[1])
    pad = (mask == 0).all(dim=0)
    for key in LABEL_KEYS:
        labels = batch.get(key)
        if not _per_token(labels, shape):
            continue
        if labels.dim() != 2 or labels.is_floating_point() or labels.dtype == torch.bool:
            return 0  # per-token targets without an ignore index: no column is known to carry no loss
        pad = pad & (labels == IGNORE_INDEX).all(dim=0)
    # the run of True at the end: a cumulative product from the right stops at the first real column
    return pad.flip(0).to(torch.int32).cumprod(0).sum().clamp(max=shape[1] - 1)


def trailing_padding(micro: list[Any]) -> list[int]:
    """For each micro-batch, its trailing columns that are padding in every row (``attention_mask == 0``) and, where
    it has per-token ``labels``, hold ``-100`` in every row; 0 for a batch without a 2-D mask. One sync in all."""
    return read_back([pending_trailing_padding(mb) for mb in micro])


def trim_right(batch: Any, keep: int) -> Any:
    """``batch`` with every tensor value of the attention mask's (B, T) leading shape cut to its first ``keep``
    columns (contiguous, as a collator that padded only that far makes them); other values as they are. The
    container keeps its type (``memopt.step.batch_tree.rebuilt``: a ``BatchEncoding`` stays one, else a
    dict). ``keep == T`` returns ``batch`` itself."""
    mask = _mask(batch)
    if mask is None or keep >= mask.shape[1]:
        return batch
    if keep < 1:
        raise ValueError(f"keep must be at least 1 column, got {keep}")
    shape = (mask.shape[0], mask.shape[1])
    return rebuilt(batch, {k: v[:, :keep].contiguous() if _per_token(v, shape) else v for k, v in batch.items()})


def drop_trailing(micro: list[Any], trailing: list[int]) -> list[Any]:
    """Each micro-batch without its ``trailing`` padding columns (:func:`trailing_padding`)."""
    return [trim_right(mb, _mask(mb).shape[1] - n) if n else mb for mb, n in zip(micro, trailing)]


def model_loss(model: nn.Module, batch: Mapping) -> torch.Tensor | None:
    """The loss the model returns for ``batch`` (``output.loss``), or None when its output carries none."""
    return getattr(model(**batch), "loss", None)


def _padded(batch: Mapping, extra: int, pad_token_id: int) -> Any:
    """``batch`` with ``extra`` right-padding columns: mask 0, labels -100, floats 0, and other integers the batch's
    own pad value (what its collator wrote under a 0 of the mask; the model's ``pad_token_id``, else 0, when the
    batch has no padding): a model that finds padding by its token id is checked with the id the data uses."""
    mask = _mask(batch)
    assert mask is not None
    shape = (mask.shape[0], mask.shape[1])
    padded_at = mask == 0

    def pad(key: str, t: torch.Tensor) -> torch.Tensor:
        tail = (t.shape[0], extra, *t.shape[2:])
        if key == "attention_mask" or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            return torch.cat([t, t.new_zeros(tail)], dim=1)
        if key in LABEL_KEYS:
            return torch.cat([t, t.new_full(tail, IGNORE_INDEX)], dim=1)
        seen = t[padded_at]
        fill = seen[:1] if seen.shape[0] else t.new_full((1, *t.shape[2:]), pad_token_id)
        return torch.cat([t, fill.reshape(1, 1, *t.shape[2:]).expand(tail)], dim=1)

    return rebuilt(batch, {k: pad(k, v) if _per_token(v, shape) else v for k, v in batch.items()})


_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def padding_invariant(model: nn.Module, batch: Any, loss_of: LossOf = model_loss, *,
                      extras: tuple[int, ...] = (1, 2, 3)) -> tuple[bool, str]:
    """(ok, reason): whether the loss of ``batch`` (a real micro-batch with a 2-D ``attention_mask``, on the model's
    device) is unchanged by more right-padding columns: by each of ``extras`` (a strided convolution over the
    sequence sees some counts and not others), by as many again as the batch is wide, and by cutting its own trailing
    padding (a model that switches on length, such as long-context rotary factors past a threshold), all losses
    finite and equal within rtol 2e-6
    (atol 1e-7). Measured in eval mode without gradients; train mode and random state are restored. The caller runs
    it in fp32 (a mixed-precision forward differs by more than that between sequence lengths); half-precision
    weights are refused. ``reason`` says why trimming padding is off, or that it is exact."""
    mask = _mask(batch)
    if mask is None:
        return False, "the batch has no 2-D attention_mask"
    half = next((p.dtype for p in model.parameters() if p.dtype in (torch.float16, torch.bfloat16)), None)
    if half is not None:  # at 8 or 11 bits of mantissa, kernels chosen by sequence length differ by more than 2e-6
        return False, f"the model's weights are {str(half).removeprefix('torch.')}: padding invariance cannot be " \
                      "measured to fp32 precision"
    norms = [type(m).__name__ for m in model.modules() if isinstance(m, _BATCH_NORMS) and m.training]
    if norms:  # eval mode hides it: in training its statistics would count the padded positions
        return False, f"the model has BatchNorm ({norms[0]}), whose training statistics see padded positions"
    config = getattr(getattr(model, "module", model), "config", None)
    pad_token_id = getattr(config, "pad_token_id", None)
    fill = pad_token_id if isinstance(pad_token_id, int) else 0
    width = int(mask.shape[1])
    own = width - read_back([pending_trailing_padding(batch)])[0]
    variants = [(f"{extra} more column(s) of right padding", _padded(batch, extra, fill))
                for extra in sorted({*extras, width})]
    if own < width:  # the cut itself: long-context rotary factors switch back below a length
        variants.append((f"its {width - own} trailing padding column(s) cut", trim_right(batch, own)))
    try:
        with side_effects_undone(model):
            plain = loss_of(model, batch)
            longer = [(what, loss_of(model, changed)) for what, changed in variants]
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # a forward that refuses the longer batch is no evidence of invariance
        return False, f"the model fails on a right-padded batch ({type(exc).__name__}: {str(exc)[:120]})"
    if not isinstance(plain, torch.Tensor) or not all(isinstance(v, torch.Tensor) for _, v in longer):
        return False, "the model's output has no loss to compare (no labels in the batch?)"
    plain = plain.detach().float()
    for what, value in longer:
        value = value.detach().float()
        if not (torch.isfinite(plain).all() and torch.isfinite(value).all()):
            return False, "the loss of the sample micro-batch is not finite, so no comparison can tell"
        if value.shape != plain.shape or not torch.allclose(plain, value, rtol=2e-6, atol=1e-7):
            return False, (f"the loss changes with {what} ({float(plain.sum()):.7g} -> {float(value.sum()):.7g}): "
                           "padded positions reach the loss (a convolution over the sequence, a mean over all "
                           "positions, a length-dependent position encoding)")
    return True, "the loss is unchanged by right padding"


@dataclass
class PaddingCut:
    """Whether trailing padding is cut off each micro-batch: ``on`` is None until the first split batch is
    measured (by the caller's ``verdict``: :func:`padding_invariant` with its loss and precision), then holds for
    every later batch. One object is shared by every train step built for the same user (the plan's, the autotune's
    candidates, the guard's re-plans), so the check runs once. ``reason`` says why it is on or off."""

    on: bool | None = None
    reason: str = ""
    noted: bool = False  # the verdict went into the plan's notes (:meth:`note`)

    def counts_and_micro(self, micro: list[Any], causal: bool, verdict: Verdict) -> tuple[list[int], list[Any]]:
        """The loss items of each micro-batch (``count_pending``), and the micro-batches without their trailing
        padding when cutting is on. Counted before cutting: only ``-100`` labels are cut, so the counts are the
        same. Once decided, the counts and the padding widths are read back in one sync."""
        pending = [count_pending(mb, causal=causal) for mb in micro]
        if self.on:  # one sync for the counts and the padding widths together
            values = read_back(pending + [pending_trailing_padding(mb) for mb in micro])
            counts, trailing = values[:len(micro)], values[len(micro):]
            return counts, drop_trailing(micro, trailing)
        counts = read_back(pending)
        if self.on is None:
            if _mask(micro[0]) is None:  # no padding to speak of: nothing measured, nothing noted
                self.on, self.reason, self.noted = False, "the batch has no 2-D attention_mask", True
            else:
                # measured on the micro-batch with loss items that loses the most columns: the cut itself is checked
                trailing = trailing_padding(micro)
                labelled = [i for i, n in enumerate(counts) if n > 0] or [0]
                self.on, self.reason = verdict(micro[max(labelled, key=lambda i: trailing[i])])
                if self.on:
                    return counts, drop_trailing(micro, trailing)
        return counts, micro

    def note(self) -> str | None:
        """The verdict as a plan note, once (None before the verdict and after the note)."""
        if self.on is None or self.noted:
            return None
        self.noted = True
        return (f"trailing padding is cut off each micro-batch before its forward ({self.reason})" if self.on else
                f"each micro-batch keeps the whole batch's padding: {self.reason}")
