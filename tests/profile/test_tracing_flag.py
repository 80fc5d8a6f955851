"""memopt runs the user's model, loss and hooks on fake tensors to trace the step; ``memopt.is_tracing()`` says so,
so a hook that keeps what it sees can skip those calls, and the plan says that the model's hooks ran in the trace."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import memopt


def test_a_hook_that_skips_while_tracing_keeps_only_the_real_steps_activations():
    """Before, a feature-collecting hook held fake tensors after wrap (torch.cat of them returned a FakeTensor)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    kept, seen_while_tracing = [], []

    def collect(module, args, output):
        if memopt.is_tracing():
            seen_while_tracing.append(type(output).__name__)
            return
        kept.append(output.detach())

    model[1].register_forward_hook(collect)
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    wrapped = memopt.wrap(model, budget="4GB", sample=batch, hardware="h100_80gb", device="cpu", use_cache=False,
                          guard=False, loss_fn=lambda out, b: F.cross_entropy(out, b[1]))
    assert seen_while_tracing and set(seen_while_tracing) == {"FakeTensor"}
    assert kept == [] and not memopt.is_tracing()
    wrapped.step(batch)
    assert len(kept) == 1 and type(kept[0]) is torch.Tensor and kept[0].shape == (8, 32)
    assert any("forward hook(s) ran on fake tensors" in n and "memopt.is_tracing()" in n for n in wrapped.plan.notes)


def test_a_model_without_hooks_gets_no_such_note():
    model = nn.Sequential(nn.Linear(16, 4))
    plan = memopt.plan(model, (torch.randn(8, 16), torch.randint(0, 4, (8,))), budget="4GB", hardware="h100_80gb",
                       loss_fn=lambda out, b: F.cross_entropy(out, b[1]), use_cache=False)
    assert not any("forward hook" in n for n in plan.notes)
