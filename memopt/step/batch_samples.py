"""A batch's samples: how many it holds along dim 0, or why it holds none to split (an indivisible batch).

Every tensor with at least one dimension holds the samples along dim 0, all the same number of them; 0-d tensors and
non-tensor leaves go with every sample. A list of dicts inside the batch as long as those samples (a detection
batch's targets, one dict per image) holds one record per sample, each with tensors of its own sizes; so does a list
or tuple of plain values as long as the samples (texts or ids a collator keeps beside the tensors), whose items pair
with the rows. A batch whose
tensors disagree on dim 0 (a graph: node features beside a ``(2, edges)`` edge index) is ``indivisible``: one
sample, trained whole. Splitting into micro-batches, sharding over ranks (``memopt.step.batch``), the plan's global
batch and the Trainer's batch size all count samples here, so they agree on what a sample is; the checks that only
dense, padded batches are planned sit here for the same reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from memopt.step.batch_tree import fields, is_dataclass_batch, is_namedtuple, leaves

__all__ = ["TRAINED_WHOLE", "batch_size", "indivisible", "record_ids", "record_lists", "unsplit_lists"]


def _is_record_list(node: Any) -> bool:
    """A list of dicts (one per sample, each with its own tensors), or a list or tuple of values without tensors
    (one text, id or list of ids per sample): a candidate for one record per sample."""
    if not isinstance(node, (list, tuple)) or is_namedtuple(node) or not node:
        return False
    if type(node) is list and all(isinstance(r, Mapping) for r in node):
        return True
    return type(node) in (list, tuple) and not any(leaves(r) for r in node)


def _record_candidates(batch: Any, path: str = "", top: bool = True) -> tuple[list[tuple[str, list]],
                                                                              list[tuple[str, torch.Tensor]]]:
    """(lists of records below the batch's top, the tensors outside them): a detection batch's targets, one dict
    per image, each holding its own number of boxes along its dim 0; a collator's texts, one per row."""
    if not top and _is_record_list(batch):
        return [(path, batch)], []
    if isinstance(batch, torch.Tensor):
        return [], [(path or "batch", batch)]
    if isinstance(batch, Mapping):
        items = [(f"{path}.{k}" if path else str(k), v) for k, v in batch.items()]
    elif isinstance(batch, (list, tuple)):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(batch)]
    elif is_dataclass_batch(batch):
        items = [(f"{path}.{k}" if path else k, getattr(batch, k)) for k in fields(batch)]
    else:
        return [], []
    lists: list[tuple[str, list]] = []
    outside: list[tuple[str, torch.Tensor]] = []
    for sub, v in items:
        more, ts = _record_candidates(v, sub, False)
        lists += more
        outside += ts
    return lists, outside


def record_lists(batch: Any) -> list[tuple[str, list]]:
    """(path, list) of the batch's lists of per-sample records: a list of dicts (below the top) as long as the
    samples every tensor outside such lists holds along dim 0. Each record is one sample's, whatever its tensors'
    own dim 0: a micro-batch takes its samples' records, never rows of every record's tensors."""
    lists, outside = _record_candidates(batch)
    if not lists:
        return []
    sizes = {int(t.shape[0]) for _, t in outside if t.dim() > 0}
    return [(path, lst) for path, lst in lists if sizes == {len(lst)}]


def unsplit_lists(batch: Any) -> list[str]:
    """The batch's lists of plain values that are not as long as its samples, described by path and length: memopt
    hands them whole to every micro-batch, which a loss pairing their items with the rows does not expect."""
    lists, outside = _record_candidates(batch)
    sizes = {int(t.shape[0]) for _, t in outside if t.dim() > 0}
    if len(sizes) != 1:
        return []
    n = next(iter(sizes))
    return [f"{path} ({len(lst)} items beside {n} samples)" for path, lst in lists if len(lst) != n]


def record_ids(batch: Any) -> frozenset[int]:
    return frozenset(id(lst) for _, lst in record_lists(batch))


def _sizes(batch: Any) -> dict[int, list[str]]:
    """Dim 0 of every tensor with a dimension -> the tensors' paths (dense tensors only); a list of per-sample
    records counts by its length, its records' tensors not at all."""
    sizes: dict[int, list[str]] = {}
    records = record_lists(batch)
    inside = {id(t) for _, lst in records for _, t in leaves(lst)}
    for path, t in leaves(batch):
        if t.layout != torch.strided:  # it cannot be cut into micro-batches by rows, nor traced as bytes
            raise ValueError(f"the batch's {path} is a {str(t.layout).removeprefix('torch.')} tensor: memopt plans "
                             "and splits dense (strided) tensors only; pass it dense (.to_dense())")
        if t.dim() > 0 and id(t) not in inside:
            sizes.setdefault(int(t.shape[0]), []).append(path)
    for path, lst in records:
        sizes.setdefault(len(lst), []).append(path)
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
