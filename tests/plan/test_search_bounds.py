"""The search drops a candidate without tracing it when a lower bound of its step time is above the runners-up's.
A bound above a candidate's own estimate could drop the fastest plan, so each bound is checked against the estimate
of every candidate, and the host's share of the bound is checked to bind where the host is the limit (small models)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt
import memopt.plan.search as search_module
from memopt.estimate.estimator import estimate_strategy
from memopt.hardware import load_hardware
from memopt.models import with_overrides
from memopt.plan import Policy
from memopt.plan.context import search_context
from memopt.plan.search import candidates
from memopt.plan.search_bounds import optimistic_time, refined_time

HW = load_hardware("h200")


class ConvNet(nn.Module):
    """Convolutions, batch norm and pooling: ops of another kind than a transformer block's."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
                                    for _ in range(3))
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x.mean((2, 3)))


SPEC = with_overrides("tiny_llama", {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                                     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512})
SAMPLE = {"batch_size": 2, "seq_len": 32}


def _llama():
    return memopt.profile(SPEC, sample=SAMPLE, hardware=HW, use_cache=False)


def _conv():
    sample = (torch.randn(2, 3, 16, 16), torch.randint(0, 10, (2,)))
    return memopt.profile(ConvNet(), sample, hardware=HW, use_cache=False,
                          loss_fn=lambda out, b: F.cross_entropy(out, b[1]))


def _adapted(s) -> bool:
    """The adapter and quantized-base levels in mixed precision, without and with checkpointing (their traces are
    the slowest to make: the rest of the grid is covered above)."""
    return (bool(s.extras) and s.precision == "bf16_autocast" and not s.chunked_ce and not s.activation_offload
            and s.checkpointing.mode != "selective" and s.checkpointing.num_blocks is None)


@pytest.mark.slow
@pytest.mark.parametrize("make, fidelity, keep", [(_llama, "lossy", None), (_conv, "lossy", None),
                                                  (_llama, "qlora", _adapted)], ids=["llama", "conv", "llama-qlora"])
def test_every_bound_is_below_its_candidates_estimate(make, fidelity, keep):
    prof = make()
    pol = Policy.build(fidelity=fidelity)
    ctx = search_context(prof, HW, 2, pol, user_optimizer=False)
    cands = [s for s in candidates(ctx, pol) if keep is None or keep(s)]
    seen, cache, host_bound = set(), {}, 0
    for s in cands:
        # the allocator mode changes neither bound nor the quick estimate's time
        key = s.replace(expandable_segments=True)
        if key in seen:
            continue
        seen.add(key)
        est = estimate_strategy(prof, s, hardware=HW, exact_reserved=False)
        low, refined = optimistic_time(prof, s, HW, "amp", cache), refined_time(prof, s, HW, "amp", cache)
        assert low <= refined <= est.step_time_s, (s.label(), low, refined, est.step_time_s)
        host_bound += refined > 2 * low
    # these models are bound by the host: the GPU-only bound is far below, the refined one is not
    assert host_bound > len(seen) // 2


def test_the_refined_bound_prunes_without_changing_the_plan(monkeypatch):
    """The plan with the refined bound is the plan without it, found with fewer candidates traced."""
    prof = _llama()
    plan = memopt.plan(SPEC, SAMPLE, budget="40GB", hardware=HW, profile=prof, fidelity="lossy")
    monkeypatch.setattr(search_module, "refined_time", lambda *a, **k: 0.0)
    without = memopt.plan(SPEC, SAMPLE, budget="40GB", hardware=HW, profile=prof, fidelity="lossy")
    assert plan.strategy == without.strategy and plan.prediction == without.prediction
    assert plan.runners_up == without.runners_up
    # what the pruned values lost by is said from their bounds: a value never traced is still explained
    assert "lower bound; not traced" in " ".join(plan.rejected.values())
    assert plan.search["evaluated"] < without.search["evaluated"] // 4
    assert plan.search["pruned_as_slower"] > without.search["pruned_as_slower"]



