"""Which items a loss counts, measured rather than assumed: whether it shifts its token labels by one, and whether
it divides by a ``num_items_in_batch`` the batch carries.

**The label shift.** A loss that predicts token ``i+1`` at position ``i`` (every Hugging Face causal LM, but also
BLIP's captioning decoder, LLaVA and the other vision-to-text heads outside transformers' causal-LM mapping) gives
the first label of each row no loss, so its micro-batches are weighted by the labels after it; a loss over every
position (XLNet's LM head, in that mapping all the same, a masked LM, a token tagger) counts them all. The class
only suggests which (``memopt.models.hf_task.is_causal_lm``): the first batch with a label at position 0 measures
it, with two forwards of one of its samples: its labels all -100 but position 0's, then all but position 1's. A
loss with nothing to average over is NaN (0/0) or 0; a loss over the first label alone is positive and finite. The
first label carries no loss while the second does: shifted; both carry loss: unshifted; anything else leaves the
class's word standing.

**num_items_in_batch.** transformers' way to make a loss exact under accumulation: the model sums its token losses
and divides by the count the batch gives, the same for every micro-batch. Each micro-batch's loss is then its share
of the whole batch's, to be added unweighted (a sum), not weighted again as a mean. Whether the loss divides by it
is measured once (the loss with the count doubled halves); a loss that ignores it is weighted as any other, and one
that changes otherwise is refused.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from memopt.step import batch as _batch
from memopt.step.batch_samples import batch_size
from memopt.step.batch_tree import is_fake, tree_map
from memopt.step.loss_reduction import LossNotSplittable
from memopt.step.side_effects import side_effects_undone
from memopt.techniques.precision import forward_context

__all__ = ["NUM_ITEMS", "divides_by_count", "first_label_decides", "measure_label_shift", "num_items_normalises"]

NUM_ITEMS = "num_items_in_batch"


def first_label_decides(batch: Any) -> bool:
    """Whether shifted and unshifted counts of ``batch``'s labels differ: per-token integer labels of 2 positions or
    more, some carrying loss at position 0."""
    labels = _batch.token_labels(batch, causal=True)
    if labels is None or labels.shape[-1] < 1 or is_fake(labels):
        return False
    full = _batch.labels_of(batch)
    return bool((full[..., 0] != _batch.IGNORE_INDEX).any())


def measure_label_shift(model: nn.Module, batch: Any, loss_fn: Any, *, precision: str, device_type: str,
                        device: torch.device | str | None = None) -> bool | None:
    """True when the loss of one sample of ``batch`` (moved to ``device``) gives its labels' first position no loss
    and the second one a loss, False when both carry loss, None when the forwards cannot tell (they fail, or
    neither carries loss)."""
    full = _batch.labels_of(batch)
    rows = (full[..., 0] != _batch.IGNORE_INDEX).reshape(full.shape[0], -1).any(dim=1).nonzero()
    if not len(rows):
        return None
    row = int(rows[0, 0])
    one = _batch.to_device(_batch.split(batch, 1)[row] if batch_size(batch) > 1 else batch, device)
    labels = _batch.labels_of(one)
    value = labels[..., :1]

    def only_at(position: int) -> Any:
        kept = torch.full_like(labels, _batch.IGNORE_INDEX)
        kept[..., position:position + 1] = value
        return tree_map(lambda t: kept if t is labels else t.clone(), one)

    try:
        with side_effects_undone(model), forward_context(precision, device_type):
            first, second = (float(_batch.compute_loss(model, only_at(p), loss_fn)) for p in (0, 1))
    except Exception:  # the class's word stands: a loss that cannot take a row of -100 labels tells nothing
        return None
    carries = [math.isfinite(v) and abs(v) > 1e-12 for v in (first, second)]
    if carries[1]:
        return not carries[0]
    return None


def num_items_normalises(model: nn.Module, batch: Mapping, loss_fn: Any, *, precision: str,
                         device_type: str) -> bool:
    """Whether the loss of ``batch`` (a micro-batch on the device that carries :data:`NUM_ITEMS` and loss items)
    divides by that count: its loss halves when the count doubles. False when the count changes nothing; raises
    :class:`LossNotSplittable` when it changes the loss otherwise."""
    given = batch[NUM_ITEMS]
    with side_effects_undone(model), forward_context(precision, device_type):
        once, twice = (float(_batch.compute_loss(model, _with_count(batch, given, k), loss_fn)) for k in (1, 2))
    return divides_by_count(once, twice)


def divides_by_count(once: float, twice: float) -> bool:
    """From a loss given the item count (``once``) and twice that count (``twice``): whether it divides by the
    count (it halves), or ignores it (it stays); raises :class:`LossNotSplittable` for any other change."""
    scale = max(abs(once), abs(twice))
    if math.isfinite(scale) and scale > 1e-12:
        if abs(once - twice) <= 1e-4 * scale:
            return False
        if abs(once - 2 * twice) <= 1e-4 * scale:
            return True
    raise LossNotSplittable(
        f"the batch's {NUM_ITEMS} changes its loss from {once:.6g} to {twice:.6g} when doubled, neither a loss "
        "divided by it nor one that ignores it, so micro-batches cannot reproduce its gradient: give a budget that "
        f"fits the whole batch, or leave {NUM_ITEMS} out of the batch")


def _with_count(batch: Mapping, given: Any, factor: int) -> Any:
    """A copy of ``batch`` whose count is ``factor`` times ``given``, of its type (an int, a tensor)."""
    count = given * factor if not isinstance(given, torch.Tensor) else given.clone() * factor
    copy = tree_map(lambda t: t.clone(), {k: v for k, v in batch.items() if k != NUM_ITEMS})
    copy[NUM_ITEMS] = count
    return copy
