"""The loss-reduction check (memopt.step.loss_reduction) on a step that needs gradients to compute its loss: a
gradient penalty (WGAN-GP, R1, a PINN's residual) differentiates the output with ``torch.autograd.grad(...,
create_graph=True)``, which fails without gradients. Its summed loss is measured as a sum and trains through
micro-batches as the unwrapped loop, and the check leaves no gradient on the parameters."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import memopt
from memopt.step.batch import TrainingStep
from memopt.step.loss_reduction import classify_reduction
from tests.reference_loop import losses_of_plain_loop


def _critic() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))


def _penalised(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A critic's summed output plus a gradient penalty, both summed over the samples."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    grad, = torch.autograd.grad(out.sum(), x, create_graph=True)
    return out.sum() + ((grad.norm(dim=1) - 1) ** 2).sum()


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 10, generator=g) for _ in range(3)]


def test_a_gradient_penalty_summed_over_samples_trains_through_micro_batches_as_the_unwrapped_loop():
    """Measured without gradients, the check failed and took the sum for a mean: every step scaled by 1/4."""
    batches = _batches()
    ref = _critic()
    model = copy.deepcopy(ref)
    want = losses_of_plain_loop(ref, batches, _penalised, torch.optim.SGD(ref.parameters(), lr=1e-2))
    w = memopt.wrap(model, budget="4GB", sample=batches[0], hardware="h100_80gb", device="cpu", use_cache=False,
                    guard=False, training_step=_penalised, pins={"micro_batch_size": 2, "precision": "fp32"},
                    optimizer=lambda params: torch.optim.SGD(params, lr=1e-2))
    got = [w.step(b) for b in batches]
    assert w._reduction.mode == "sum"
    assert got == pytest.approx(want, rel=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_the_check_with_gradients_leaves_the_parameters_gradients_as_they_were():
    model = _critic()
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    verdict = classify_reduction(model, _batches()[0], TrainingStep(_penalised), precision="fp32", device_type="cpu")
    assert verdict == ("sum", "")
    assert all(bool((p.grad == 0.5).all()) for p in model.parameters())
    assert model.training
