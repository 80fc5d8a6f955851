"""A dict batch whose tensors all sit in nested containers (no tensor at its top level) is a batch, not a dict of
sample shapes: memopt.wrap trains it, given as sample= or first met at step, exactly as the unwrapped loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _batches(nest) -> list:
    g = torch.Generator().manual_seed(1)
    return [nest(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(3)]


_NESTINGS = {
    "dict of dicts": (lambda x, y: {"inputs": {"x": x}, "targets": {"y": y}},
                      lambda m, b: F.cross_entropy(m(b["inputs"]["x"]), b["targets"]["y"])),
    "dict of tuples": (lambda x, y: {"inputs": (x,), "targets": (y,)},
                       lambda m, b: F.cross_entropy(m(b["inputs"][0]), b["targets"][0])),
}


@pytest.mark.parametrize("given", ["sample", "first step"])
@pytest.mark.parametrize("micro", [8, 2])
@pytest.mark.parametrize("nesting", sorted(_NESTINGS))
def test_a_dict_batch_with_no_tensor_at_its_top_level_trains_as_the_unwrapped_loop(nesting, micro, given):
    nest, step = _NESTINGS[nesting]
    batches = _batches(nest)
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = []
    for b in batches:
        loss = step(ref, b)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        want.append(loss.item())
    model = _model()
    w = memopt.wrap(model, budget="4GB", sample=batches[0] if given == "sample" else None, hardware="h100_80gb",
                    device="cpu", use_cache=False, guard=False, training_step=step,
                    optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                    pins={"micro_batch_size": micro, "precision": "fp32"})
    got = [w.step(b) for b in batches]
    assert w.plan.strategy.micro_batch_size == micro
    assert got == pytest.approx(want, rel=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
