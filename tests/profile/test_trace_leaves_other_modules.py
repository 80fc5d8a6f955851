"""The trace runs the user's training step on fake tensors; a module the step runs besides the model (a GAN's
discriminator, a teacher) keeps its real weights there, and the traced backward reaches them. Their gradients are
left as they were: before, the discriminator's .grad was a FakeTensor after wrap(generator), and its next real step
added into it and lost the update."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import memopt

DISCRIMINATOR = nn.Linear(6, 1)  # a script's global, read by the generator's step by name


def _generator_step_on_the_global(model, batch):
    return DISCRIMINATOR(model(batch)).mean()


@pytest.mark.parametrize("held", ["closure", "global"])
def test_the_trace_leaves_the_gradients_of_a_module_the_step_runs_as_they_were(held):
    torch.manual_seed(0)
    generator = nn.Linear(4, 6)
    discriminator = nn.Linear(6, 1) if held == "closure" else DISCRIMINATOR
    step = (lambda m, b: discriminator(m(b)).mean()) if held == "closure" else _generator_step_on_the_global
    before = copy.deepcopy(discriminator)
    memopt.wrap(generator, budget="4GB", sample=torch.randn(8, 4), hardware="h100_80gb", device="cpu", guard=False,
                use_cache=False, training_step=step, optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    assert all(p.grad is None for p in discriminator.parameters())
    x = torch.randn(8, 6)  # the discriminator's own real step is the plain one
    opt = torch.optim.SGD(discriminator.parameters(), lr=0.1)
    discriminator(x).mean().backward()
    opt.step()
    ref_opt = torch.optim.SGD(before.parameters(), lr=0.1)
    before(x).mean().backward()
    ref_opt.step()
    for p, q in zip(discriminator.parameters(), before.parameters()):
        assert torch.equal(p, q)
