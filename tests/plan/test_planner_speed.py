"""The planner's shortcuts change nothing it reports: the weights floor, and the infeasibility report's bounds."""

import dataclasses

import pytest

import memopt
import memopt.plan.search as search_module
from memopt.estimate.estimator import estimate_strategy
from memopt.hardware import load_hardware
from memopt.models import with_overrides
from memopt.plan import Policy
from memopt.plan.planner import _context, _Estimates, _min_footprint
from memopt.plan.policy import ALLOWANCES
from memopt.plan.search import candidates, evaluate, extras_saving, weights_floor

SPEC = with_overrides("tiny_llama", {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 512,
                                     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 40960})
SAMPLE = {"batch_size": 2, "seq_len": 64}
HW = load_hardware("h200")
GB = 10**9


@pytest.fixture(scope="module")
def prof():
    return memopt.profile(SPEC, sample=SAMPLE, hardware=HW, use_cache=False)


def test_the_weights_floor_is_below_every_estimate(prof):
    pol = Policy.build(fidelity="lossy", pins={"expandable_segments": True, "attention": "auto"})
    ctx = _context(prof, HW, 2, pol, user_optimizer=False)
    for s in candidates(dataclasses.replace(ctx, max_micro_batch=1), pol):
        est = estimate_strategy(prof, s, hardware=HW, exact_reserved=False)
        assert weights_floor(prof, s, HW) <= est.peak_allocated_bytes + est.runtime_bytes


def _brute_min(prof, pol, ctx, budget):
    """The report's smallest footprint as it was computed before the bounds: every head candidate simulated."""
    cands = candidates(dataclasses.replace(ctx, max_micro_batch=1), pol)

    def rank(s):  # the most saving extras level, then the memory-saving extremes; offload tried both ways
        return (-extras_saving(s), s.checkpointing.mode != "full" or s.checkpointing.num_blocks is not None,
                -s.chunked_ce, s.optimizer not in ("adamw8bit", "paged_adamw8bit"), not s.expandable_segments)

    cands.sort(key=rank)
    best = None
    for s in [c for c in cands if rank(c) == rank(cands[0])][:16]:
        ev = evaluate(prof, s, HW, budget, pol.margin(budget))
        if ev.estimate is not None and (best is None or ev.total_bytes < best.total_bytes):
            best = ev
    return best


def test_min_footprint_with_bounds_equals_simulating_every_candidate(prof):
    budget = 2 * GB
    base = Policy.build()
    ctx = _context(prof, HW, 2, base, user_optimizer=False)
    shared = _Estimates(prof, HW)
    for pol in [base] + [base.relaxed(a) for a in ALLOWANCES if a not in base.allow]:
        fast = _min_footprint(prof, HW, pol, ctx, budget, shared)
        brute = _brute_min(prof, pol, ctx, budget)
        assert fast.strategy == brute.strategy
        assert fast.total_bytes == brute.total_bytes and fast.fits == brute.fits
        assert fast.estimate.to_dict() == brute.estimate.to_dict()
    assert len(shared.exact) < len(shared.quick)  # the bounds skipped some simulations


def _no_floor(profile, s, hw, cache=None):
    return 0


@pytest.mark.parametrize("budget", [1.0 * GB, 1.16 * GB, 1.3 * GB, 40 * GB])
def test_plans_are_the_same_without_the_weights_floor(prof, monkeypatch, budget):
    with_floor = memopt.plan(SPEC, SAMPLE, budget=int(budget), hardware=HW, profile=prof, fidelity="lossy")
    monkeypatch.setattr(search_module, "weights_floor", _no_floor)
    without = memopt.plan(SPEC, SAMPLE, budget=int(budget), hardware=HW, profile=prof, fidelity="lossy")
    assert with_floor.fits == without.fits and with_floor.strategy == without.strategy
    assert with_floor.prediction == without.prediction
    assert with_floor.infeasible == without.infeasible
    a, b = with_floor.search, without.search
    assert a["evaluated"] + a["pruned_as_too_big"] + a["pruned_as_slower"] == a["candidates"]
    assert a["evaluated"] <= b["evaluated"]
