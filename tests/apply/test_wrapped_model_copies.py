"""A wrapped model copied (``copy.deepcopy``: an EMA, ``AveragedModel``, a best-model snapshot) or pickled
(``torch.save(model)``) while memopt trains it. The copy is a model of its own: it holds none of the wrapper (its
optimizer states, guard, profile), runs its blocks' own forward, and can be wrapped or trained as any model; the
wrapped model itself stays wrapped."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import memopt
from memopt.models import build_model
from tests.reference_loop import losses_of_plain_loop

KW = {"budget": "4GB", "hardware": "h100_80gb", "device": "cpu"}


def _batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 200, (4, 32), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("tiny_llama", device="cpu")


@pytest.mark.parametrize("precision", ["fp32", "bf16_master"])
def test_a_copy_of_a_wrapped_model_is_a_model_of_its_own(precision):
    batches = [_batch(i) for i in range(3)]
    model = _model()
    w = memopt.wrap(model, sample=batches[0], lr=1e-3, fidelity="mixed",
                    pins={"precision": precision, "checkpointing": "full"}, **KW)
    w.step(batches[0])
    ema = torch.optim.swa_utils.AveragedModel(model)  # deep-copies the model
    best = copy.deepcopy(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    model.eval()
    for other in (ema.module, best, loaded):
        assert other.__dict__.get("memopt_wrapper") is None
        assert not any(type(m.__dict__.get("forward")).__name__ == "_CheckpointedForward" for m in other.modules())
        other.eval()
        with torch.no_grad():
            assert torch.equal(other(**batches[1]).logits, model(**batches[1]).logits)
    model.train()
    with pytest.raises(ValueError, match=r"^this model is already wrapped by memopt.wrap"):
        memopt.wrap(model, sample=batches[0], **KW)

    # the copy trains, wrapped, as an unwrapped loop trains another copy of it (a bf16_master model's copy holds
    # its bf16 weights, whose optimizer steps round differently from one implementation to another)
    best.train()
    ref = copy.deepcopy(best)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0)
    expected = losses_of_plain_loop(ref, batches[1:], lambda m, b: m(**b).loss, opt)
    again = memopt.wrap(best, sample=batches[0], lr=1e-3, pins={"precision": "fp32"}, **KW)
    exact = precision == "fp32"
    assert [again.step(b) for b in batches[1:]] == pytest.approx(expected, rel=1e-5 if exact else 1e-2)
    for p, q in zip(best.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6 if exact else 4e-3)
