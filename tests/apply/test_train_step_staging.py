"""The train step's batch handling: loss-item counts with at most one host sync, every micro-batch staged on the
device before the first forward, and the guard's census off by default (it costs a Python call per saved tensor)."""

import torch

from memopt.step.train_step import _stage, count_loss_items, loss_item_counts, split_batch


def _batch() -> dict:
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 50, (8, 16), generator=g)
    labels[labels % 3 == 0] = -100
    return {"input_ids": torch.randint(0, 50, (8, 16), generator=g), "labels": labels, "note": "kept"}


def test_counts_match_count_loss_items_for_every_micro_batch():
    micro = split_batch(_batch(), 2)
    for causal in (False, True):
        assert loss_item_counts(micro, causal) == [count_loss_items(mb, causal=causal) for mb in micro]
    per_sample = [{"x": torch.zeros(3, 4), "labels": torch.tensor([1, 0, 1])}]
    assert loss_item_counts(per_sample, False) == [3]  # per-sample labels count samples


def test_staging_moves_every_micro_batch_and_keeps_non_tensors():
    micro = split_batch(_batch(), 4)
    assert _stage(micro, None) is micro
    staged = _stage(micro, "meta")
    assert all(v.device.type == "meta" for mb in staged for k, v in mb.items() if k != "note")
    assert all(mb["note"] == "kept" for mb in staged)
    assert all(torch.equal(a["labels"], b["labels"]) for a, b in zip(_stage(micro, "cpu"), micro))


def test_runtime_guard_census_is_automatic_by_default():
    import inspect

    from memopt.guard.runtime import RuntimeGuard

    assert inspect.signature(RuntimeGuard).parameters["census"].default == "auto"
