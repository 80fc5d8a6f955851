"""A batch larger per sample than planned is named when it is stepped: it needs more memory than the plan has."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt
from memopt.models import build_model


def _lm_batch(n: int, length: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 100, (n, length))
    return {"input_ids": ids, "labels": ids}


def _stepped_warnings(wrapped: memopt.Wrapped, batch: object) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        wrapped.step(batch)
    return [str(w.message) for w in seen if "larger per sample" in str(w.message)]


def test_longer_sequences_than_planned_are_named_once() -> None:
    torch.manual_seed(0)
    w = memopt.wrap(build_model("tiny_llama", device="cpu"), budget="4GB", hardware="h100_80gb",
                    sample={"batch_size": 4, "seq_len": 32}, lr=1e-3)
    assert _stepped_warnings(w, _lm_batch(4, 32)) == []
    assert _stepped_warnings(w, _lm_batch(8, 32)) == []  # more samples: more micro-batches of the planned size
    assert _stepped_warnings(w, _lm_batch(4, 16)) == []
    said = _stepped_warnings(w, _lm_batch(4, 64))
    assert len(said) == 1 and "input_ids (4, 64) (planned per sample (32,))" in said[0] and "labels" in said[0]
    assert _stepped_warnings(w, _lm_batch(4, 64)) == []  # once per shape
    assert len(_stepped_warnings(w, _lm_batch(2, 96))) == 1


def test_larger_images_than_planned_are_named() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 2, (4,))
    w = memopt.wrap(model, budget="4GB", hardware="h100_80gb", sample=(x, y), lr=1e-3,
                    loss_fn=lambda out, b: F.cross_entropy(out, b[1]))
    assert _stepped_warnings(w, (x, y)) == []
    said = _stepped_warnings(w, (torch.randn(4, 3, 32, 32), y))
    assert len(said) == 1 and "[0] (4, 3, 32, 32) (planned per sample (3, 16, 16))" in said[0]


@pytest.mark.parametrize("factory", [None, lambda b, device: (_ for _ in ()).throw(RuntimeError("needs a GPU"))])
def test_a_profile_without_a_usable_batch_maker_watches_nothing(factory: object) -> None:
    from memopt.apply.batch_shape_watch import ShapeWatch, planned_sample_shapes

    watch = ShapeWatch(planned_sample_shapes(factory))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        watch.check(_lm_batch(4, 512))


def test_a_saved_plan_watches_its_recorded_sample(tmp_path) -> None:
    """plan= has no profile to make the planned batch: the sample the plan recorded stands for it."""
    path = memopt.plan("tiny_gpt2", {"batch_size": 4, "seq_len": 32}, budget="8GB",
                       hardware="h100_80gb").save(tmp_path / "plan.json")
    w = memopt.wrap(build_model("tiny_gpt2", device="cpu"), plan=path, lr=1e-3)
    assert _stepped_warnings(w, _lm_batch(4, 32)) == []
    said = _stepped_warnings(w, _lm_batch(4, 64))
    assert len(said) == 1 and "input_ids (4, 64) (planned per sample (32,))" in said[0]


def test_a_saved_plan_of_a_structure_batch_watches_its_tensors(tmp_path) -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 2, (4,))
    loss_fn = lambda out, b: F.cross_entropy(out, b[1])  # noqa: E731
    path = memopt.plan(model, (x, y), budget="4GB", hardware="h100_80gb", loss_fn=loss_fn).save(tmp_path / "p.json")
    w = memopt.wrap(model, plan=path, lr=1e-3, loss_fn=loss_fn)
    assert _stepped_warnings(w, (x, y)) == []
    said = _stepped_warnings(w, (torch.randn(4, 3, 32, 32), y))
    assert len(said) == 1 and "[0] (4, 3, 32, 32) (planned per sample (3, 16, 16))" in said[0]
