"""A cached profile is found by its model, sample and kernel policy, and by its loss: a loss that allocates more
(logits upcast, a copy of them) must not reuse another loss's traces."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

import memopt
from memopt.profile.loss_key import loss_key
from memopt.step.batch import as_loss


def _ce(out, b):
    return F.cross_entropy(out, b[1])


def _heavy(out, b):
    """The same loss, plus a 200,000-wide copy of the logits (205 MB at 64 x 4): what an fp32 upcast of a large
    vocabulary's logits costs."""
    big = out.unsqueeze(-1).expand(-1, -1, 200_000).contiguous()
    return F.cross_entropy(out, b[1]) + big.mean() * 0


def _smoothed(eps: float):
    return lambda out, b: F.cross_entropy(out, b[1], label_smoothing=eps)


def test_the_key_is_the_code_and_its_plain_values_not_the_object() -> None:
    assert loss_key(None) == "model"
    again = lambda out, b: F.cross_entropy(out, b[1])  # noqa: E731  the same code, defined elsewhere
    first = lambda out, b: F.cross_entropy(out, b[1])  # noqa: E731
    assert loss_key(first) == loss_key(again)
    assert loss_key(_ce) != loss_key(_heavy)
    assert loss_key(_smoothed(0.1)) != loss_key(_smoothed(0.2))  # a closure's value
    assert loss_key(_smoothed(0.1)) == loss_key(_smoothed(0.1))
    assert loss_key(nn.CrossEntropyLoss(label_smoothing=0.1)) != loss_key(nn.CrossEntropyLoss())
    assert loss_key(functools.partial(F.cross_entropy, label_smoothing=0.1)) != loss_key(F.cross_entropy)
    assert loss_key(as_loss(None, lambda m, b: _ce(m(b[0]), b))) != loss_key(_ce)
    cls_weights = torch.ones(4)  # a tensor in the closure: identified by the object, never shared wrongly
    assert loss_key(lambda out, b: F.cross_entropy(out, b[1], weight=cls_weights)) != \
        loss_key(lambda out, b: F.cross_entropy(out, b[1], weight=torch.ones(4)))


def test_a_second_plan_with_a_heavier_loss_is_not_planned_from_the_first_losss_traces(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MEMOPT_CACHE_DIR", str(tmp_path))
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))

    def peak(loss_fn, use_cache: bool = True) -> int:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        plan = memopt.plan(model, (x, y), budget="10GB", hardware="h200", loss_fn=loss_fn, use_cache=use_cache,
                           pins={"precision": "fp32", "micro_batch_size": 64})
        return plan.prediction["peak_allocated_bytes"]

    light = peak(_ce)
    heavy = peak(_heavy)
    assert heavy == peak(_heavy, use_cache=False)
    assert heavy > light + 200_000_000
    assert peak(lambda out, b: F.cross_entropy(out, b[1])) == light  # found again in the cache
