"""Common layers whose ops differ between micro-batch 1 and 2 (recurrent kernels, nn.MultiheadAttention's fast
paths): the profile's linear trace must not pair different tensors, and the composed estimate equals the
simulation of the same step on the whole model, at every micro-batch size."""

import pytest
import torch
from torch import nn

import memopt
from memopt.profile.cuda_semantics import kernel_policy_for
from memopt.profile.simulate import simulate_step
from memopt.strategy import Checkpointing, Strategy


class GRUModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 64)
        self.gru = nn.GRU(64, 64, num_layers=2, batch_first=True)
        self.head = nn.Linear(64, 4)

    def forward(self, x, labels):
        h, _ = self.gru(self.embed(x))
        return {"loss": nn.functional.cross_entropy(self.head(h[:, -1]), labels)}


class MHABlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(64, 4, batch_first=True)
        self.norm = nn.LayerNorm(64)

    def forward(self, h):
        a, _ = self.attn(h, h, h)
        return self.norm(h + a)


class MHAModel(nn.Module):
    def __init__(self, blocks: int = 1) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 64)
        self.blocks = nn.ModuleList(MHABlock() for _ in range(blocks))
        self.head = nn.Linear(64, 4)

    def forward(self, x, labels):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return {"loss": nn.functional.cross_entropy(self.head(h.mean(1)), labels)}


def _sample(n: int = 16):
    return {"x": torch.randn(n, 10, 16), "labels": torch.zeros(n, dtype=torch.long)}


def _simulated(model, sample, strategy):
    sim = simulate_step(model, lambda d: {k: torch.zeros_like(v, device=d) for k, v in sample.items()}, strategy,
                        policy=kernel_policy_for(memopt.load_hardware("h200")), num_steps=3)
    return sim.peak_allocated_bytes


@pytest.mark.parametrize("build", [GRUModel, MHAModel, lambda: MHAModel(blocks=6)], ids=["gru", "mha", "mha_blocks"])
@pytest.mark.parametrize("mb", [1, 2, 8])
def test_estimate_equals_simulation(build, mb):
    model, sample = build(), _sample()
    prof = memopt.profile(model, sample, hardware="h200", use_cache=False)
    strategy = Strategy(micro_batch_size=mb, grad_accum_steps=16 // mb)
    est = memopt.estimate(prof, strategy, num_steps=3)
    assert est.peak_allocated_bytes == pytest.approx(_simulated(model, sample, strategy), rel=0.01)


def test_checkpointed_mha_blocks_estimate_equals_simulation():
    model, sample = MHAModel(blocks=6), _sample()
    prof = memopt.profile(model, sample, hardware="h200", use_cache=False)
    strategy = Strategy(micro_batch_size=8, grad_accum_steps=2, checkpointing=Checkpointing(mode="full", num_blocks=4))
    est = memopt.estimate(prof, strategy, num_steps=3)
    assert est.peak_allocated_bytes == pytest.approx(_simulated(model, sample, strategy), rel=0.01)


def test_the_planner_keeps_plain_plans_for_a_small_recurrent_model():
    plan = memopt.plan(GRUModel(), _sample(), budget="10GB", hardware="h200")
    assert not plan.strategy.activation_offload and plan.strategy.checkpointing.mode == "none"


def _failing_for_offload(exc_type, monkeypatch):
    import memopt.plan.search as search

    real = search.estimate_strategy

    def estimate(profile, s, **kw):
        if s.activation_offload:
            raise exc_type("injected failure")
        return real(profile, s, **kw)

    monkeypatch.setattr(search, "estimate_strategy", estimate)


def test_an_internal_estimate_error_is_not_swallowed_by_the_planner(monkeypatch):
    from memopt.estimate.allocator_sim import EventStreamError

    _failing_for_offload(EventStreamError, monkeypatch)
    with pytest.raises(EventStreamError, match="injected"):
        memopt.plan(MHAModel(), _sample(), budget="10GB", hardware="h200", pins={"activation_offload": True})


def test_candidates_that_cannot_be_estimated_are_named_in_the_plan(monkeypatch):
    _failing_for_offload(ValueError, monkeypatch)
    plan = memopt.plan(MHAModel(), _sample(), budget="10GB", hardware="h200")
    assert any("cannot be estimated: injected failure" in n for n in plan.notes)
