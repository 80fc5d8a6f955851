"""A batch's samples: how many it holds along dim 0, or why it holds none to split (an indivisible batch).

Every tensor with at least one dimension holds the samples along dim 0, all the same number of them; 0-d tensors
and non-tensor leaves go with every sample. A batch whose tensors disagree on dim 0 (a graph: node features beside
a ``(2, edges)`` edge index) is ``indivisible``: one sample, trained whole. Splitting into micro-batches, sharding
over ranks (``memopt.step.batch``), the plan's global batch and the Trainer's batch size all count samples here, so
they agree on what a sample is; the checks that only dense, padded batches are planned sit here for the same reason.
"""

from __future__ import annotations

from typing import Any

import torch

from memopt.step.batch_tree import leaves

__all__ = ["TRAINED_WHOLE", "batch_size", "indivisible"]


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
