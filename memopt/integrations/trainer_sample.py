"""The sample batch memopt plans a Hugging Face ``Trainer`` for, read from the Trainer's own data.

A Trainer shuffles its dataset, so any row can come in any batch and the plan must hold for the longest: the sample
is sized by the dataset's longest rows (measured whole from a ``datasets.Dataset``'s Arrow columns, else on rows
spread over it), or is one global batch collated by the Trainer's own collator from those rows, where the model,
the Trainer's loss or rows of several lengths (padding) need the collated batch itself. A collator that packs its
rows into fewer (``PackedRows``) would change what the Trainer's batch size counts, so it is refused here.
``memopt.integrations.hf_trainer`` plans on what ``sample_from_trainer`` returns.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from memopt.profile.batch_factories import spec_from_module
from memopt.step.batch_samples import batch_size, indivisible
from memopt.step.batch_tree import is_batch, tensors

__all__ = ["ROWS_READ", "PackedRows", "collated_batch", "row_length_ranges", "sample_from_trainer"]


def sample_from_trainer(trainer: Any, sample: Any, *, own_loss: bool = False) -> Any:
    """The sample to plan for: the user's, else shapes (a model memopt makes batches for: a causal, masked or
    seq2seq LM, an image classifier, whose loss is the model's own, fed rows of one length) sized by the dataset's
    longest rows, else one global batch of the Trainer's own data, collated by its collator from its longest rows:
    any model (a classifier, a model with extra inputs), any Trainer with a loss of its own (``own_loss``: TRL's
    ``SFTTrainer.compute_loss`` reads the ``attention_mask`` and ``completion_mask`` its collator makes), and rows
    of several lengths (padded by the collator: its masks are traced)."""
    args = trainer.args
    world = max(1, getattr(args, "world_size", 1))
    global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * world
    if isinstance(sample, dict) and "batch_size" in sample:
        return sample
    if sample is not None and not isinstance(sample, dict):
        return sample  # a batch (memopt.step.batch)
    dataset = getattr(trainer, "train_dataset", None)
    if not sample and (own_loss or spec_from_module(trainer.model) is None):
        batch = collated_batch(trainer, dataset, global_batch)
        if batch is not None:
            return batch
    sized = dataset is not None and hasattr(dataset, "__len__") and len(dataset) > 0
    ranges = row_length_ranges(dataset, ("input_ids", "labels")) if sized else {}  # one pass over the rows
    shortest, longest_ids = ranges.get("input_ids", (0, 0))
    if not sample and shortest < longest_ids:
        # the collator pads them, and a padded batch runs another attention path than shapes (unpadded) describe
        try:
            batch = collated_batch(trainer, dataset, global_batch)
        except PackedRows as exc:  # rows of the longest length stand for the packed ones: more memory, never less
            warnings.warn(f"{exc}; planned instead for its rows padded to the longest, which needs at least the "
                          "memory of the packed batch", stacklevel=4)
            batch = None
        except ValueError:  # a collator that cannot pad them: the run fails on its own; plan from shapes
            batch = None
        if batch is not None:
            return batch
    extra = dict(sample or {})
    if "seq_len" not in extra and not sized and dataset is not None:
        spec = spec_from_module(trainer.model)
        if spec is not None and spec.family in ("causal_lm", "masked_lm", "seq2seq_lm"):
            raise ValueError(f"the Trainer's train_dataset ({type(dataset).__name__}) has no length (its rows stream), "
                             "so memopt cannot find its longest row to plan for: pass sample={'seq_len': <tokens in "
                             "the longest row>} (or one global batch) to memopt.wrap")
    if "seq_len" not in extra and sized:
        longest = {key: high for key, (_, high) in ranges.items()}
        if longest.get("input_ids"):
            extra["seq_len"] = longest["input_ids"]
            spec = spec_from_module(trainer.model)
            if longest.get("labels") and spec is not None and spec.family == "seq2seq_lm":
                extra.setdefault("decoder_seq_len", longest["labels"])
    return {"batch_size": global_batch, **extra}


#: rows read one by one where the dataset has no columnar store to measure (spread over the whole dataset)
ROWS_READ = 4096


def _row_indices(n: int) -> list[int]:
    if n <= ROWS_READ:
        return list(range(n))
    return sorted({round(i * (n - 1) / (ROWS_READ - 1)) for i in range(ROWS_READ)})


def _length(value: Any) -> int:
    """A row field's length (tokens); 0 for a scalar (a class label, a 0-d tensor)."""
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() else 0
    return len(value) if hasattr(value, "__len__") and not isinstance(value, (str, bytes)) else 0


def row_length_ranges(dataset: Any, keys: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """The shortest and longest value of each of ``keys`` over the dataset's rows (a Trainer shuffles: any row can
    come in any batch, and the plan must hold for the longest). A Hugging Face ``datasets.Dataset`` is measured
    whole from its Arrow columns; any other sized dataset on up to ``ROWS_READ`` rows spread over it."""
    table = getattr(dataset, "data", None)
    out: dict[str, tuple[int, int]] = {}
    if hasattr(table, "column_names") and getattr(dataset, "_indices", None) is None:
        import pyarrow.compute as pc

        for key in keys:
            if key in table.column_names:
                lengths = pc.list_value_length(table.column(key))
                out[key] = (int(pc.min(lengths).as_py() or 0), int(pc.max(lengths).as_py() or 0))
        if out:
            return out
    for i in _row_indices(len(dataset)):
        row = dataset[i]
        if not isinstance(row, dict):
            return out
        for key in keys:
            if key in row:
                n = _length(row[key])
                low, high = out.get(key, (n, n))
                out[key] = (min(low, n), max(high, n))
    return out


def _longest_row_indices(dataset: Any) -> set[int]:
    """The rows with the longest ``input_ids`` and ``labels`` of a Hugging Face ``datasets.Dataset``, found over its
    whole Arrow columns (the rows read one by one are a spread, which can miss them); empty for other datasets."""
    table = getattr(dataset, "data", None)
    if not hasattr(table, "column_names") or getattr(dataset, "_indices", None) is not None:
        return set()
    import pyarrow.compute as pc

    found = set()
    for key in ("input_ids", "labels"):
        if key in table.column_names:
            lengths = pc.list_value_length(table.column(key))
            longest = pc.max(lengths).as_py()
            if longest:
                found.add(int(pc.index(lengths, longest).as_py()))
    return found


class PackedRows(ValueError):
    """The Trainer's collator joins its rows into fewer (padding-free packing)."""


def collated_batch(trainer: Any, dataset: Any, size: int) -> Any:
    """``size`` samples of the dataset through the Trainer's collator, the longest rows first (read over the whole
    dataset, up to ``ROWS_READ`` rows spread over it: the plan must hold for the longest batch) with the shortest
    among them where lengths differ (padding), or None (no sized dataset or collator)."""
    collator = getattr(trainer, "data_collator", None)
    if dataset is None or collator is None or not hasattr(dataset, "__len__") or len(dataset) == 0:
        return None
    if hasattr(trainer, "_get_collator_with_removed_columns"):  # the columns the Trainer's loader drops, dropped
        collator = trainer._get_collator_with_removed_columns(collator, description="training")
    rows = [dataset[i] for i in sorted(set(_row_indices(len(dataset))) | _longest_row_indices(dataset))]

    def length(row: Any) -> tuple[int, int]:
        if not isinstance(row, dict):
            return 0, 0
        return _length(row.get("input_ids")), _length(row.get("labels"))

    rows.sort(key=length, reverse=True)
    if len(rows) > 1 and isinstance(rows[0], dict) and _length(rows[0].get("labels")):
        # the batch pads every key to its longest: the longest labels ride along with the longest inputs
        longest_labels = max(rows, key=lambda r: _length(r.get("labels")))
        rows = [rows[0], longest_labels, *[r for r in rows[1:] if r is not longest_labels]]
    if len(rows) > 2 and size > 1 and length(rows[-1])[0] < length(rows[0])[0]:
        # and the shortest second: rows of several lengths are padded to the longest, and a padded batch takes other
        # attention paths (a materialized mask) than one whose rows are all full; the second, so that a micro-batch
        # of two holds it (a micro-batch of one row is never padded)
        rows = [rows[0], rows[-1], *rows[1:-1]]
    rows = (rows * (size // len(rows) + 1))[:size]
    try:
        batch = collator(rows)
    except Exception as exc:  # a collator that needs what the Trainer's loader adds
        raise ValueError(f"memopt could not collate a sample batch with the Trainer's data_collator "
                         f"({type(exc).__name__}: {exc}); pass sample=<one global batch> to memopt.wrap") from None
    if len(rows) > 1 and is_batch(batch) and tensors(batch) and not indivisible(batch) \
            and batch_size(batch) < len(rows):
        # planned as it comes, a packed batch would be a batch of one row, and the plan would set the Trainer's
        # per-device batch to the rows it saw: another training than the script's
        raise PackedRows(f"the Trainer's data_collator ({type(collator).__name__}) joins the {len(rows)} rows it is "
                         f"given into {batch_size(batch)} (padding-free packing, as DataCollatorWithFlattening does): "
                         "memopt plans batches whose rows are the samples the Trainer counts; collate with padding "
                         "(DataCollatorWithPadding, DataCollatorForSeq2Seq, or TRL's padding_free=False)")
    return dict(batch) if isinstance(batch, Mapping) else batch  # a collator's BatchEncoding too
