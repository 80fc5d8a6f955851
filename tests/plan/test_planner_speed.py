"""The planner's shortcuts change nothing it reports (the model-state floor in the search, the infeasibility
report's bounds), and the floor that replaces a hopeless policy's report is a true lower bound."""

import dataclasses

import pytest

import memopt
import memopt.plan.footprint as footprint_module
import memopt.plan.plan_build as plan_build_module
import memopt.plan.search as search_module
from memopt.estimate.estimator import estimate_strategy
from memopt.hardware import load_hardware
from memopt.models import with_overrides
from memopt.plan import Policy
from memopt.plan.context import search_context
from memopt.plan.floors import state_floor
from memopt.plan.footprint import Estimates, min_footprint
from memopt.plan.policy import ALLOWANCES
from memopt.plan.search import candidates, evaluate
from memopt.techniques.optimizers import states_per_item
from memopt.techniques.registry import extras_saving

SPEC = with_overrides("tiny_llama", {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 512,
                                     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 40960})
SAMPLE = {"batch_size": 2, "seq_len": 64}
HW = load_hardware("h200")
GB = 10**9


@pytest.fixture(scope="module")
def prof():
    return memopt.profile(SPEC, sample=SAMPLE, hardware=HW, use_cache=False)


@pytest.mark.parametrize("fidelity", ["lossy", pytest.param("lora", marks=pytest.mark.slow),
                                      pytest.param("qlora", marks=pytest.mark.slow)])
def test_the_state_floor_is_below_every_estimate(prof, fidelity):
    """Every candidate (each precision, optimizer, offload, adapters, quantized base): floor <= the estimate, and
    the floor is not trivially the weights alone where the optimizer's states are known."""
    pol = Policy.build(fidelity=fidelity, pins={"expandable_segments": True, "attention": "auto"})
    ctx = search_context(prof, HW, 2, pol, user_optimizer=False)
    cands = candidates(dataclasses.replace(ctx, max_micro_batch=1), pol)
    seen = set()
    # the floor does not depend on the checkpointing; of the estimates, the least-activation one (every block
    # recomputed) binds it: the slow fidelities hold 48 and 96 combinations of the rest, six checkpointing modes each
    modes = None if fidelity == "lossy" else {"full"}
    for s in cands:
        key = (s.precision, s.optimizer, s.activation_offload, s.extras, s.checkpointing.label())
        if key in seen or (modes is not None and key[-1] not in modes):
            continue
        seen.add(key)
        est = estimate_strategy(prof, s, hardware=HW, exact_reserved=False)
        floor = state_floor(prof, s, HW)
        assert floor.total_bytes <= est.peak_allocated_bytes + est.runtime_bytes, s.label()
        if not s.extras and s.optimizer.startswith("adamw") and s.optimizer != "adamw8bit" and \
                s.precision != "bf16_pure":
            # fp32 weights or masters, fp32 gradient and two fp32 states: at least 16 bytes a parameter
            assert floor.total_bytes - floor.runtime_bytes >= 12 * prof.num_trainable_params, s.label()
    assert len(seen) > 20


def test_a_hopeless_policy_reports_its_floor_without_tracing(prof, monkeypatch):
    """Far below the model states, the report is the floor (a lower bound, said so), and nothing is estimated."""
    def no_estimates(*args, **kwargs):
        raise AssertionError("the report estimated a candidate that cannot fit")

    lossy = Policy.build(fidelity="lossy")
    cands = candidates(dataclasses.replace(search_context(prof, HW, 2, lossy, user_optimizer=False),
                                           max_micro_batch=1), lossy)
    smallest = min(state_floor(prof, s, HW).total_bytes for s in cands)
    budget = (smallest + HW.runtime_overhead_bytes) // 2  # above the runtime, below the model states
    monkeypatch.setattr(footprint_module, "estimate_strategy", no_estimates)
    monkeypatch.setattr(footprint_module, "evaluate", no_estimates)
    monkeypatch.setattr(search_module, "estimate_strategy", no_estimates)
    plan = memopt.plan(SPEC, SAMPLE, budget=budget, hardware=HW, profile=prof, fidelity="lossy",
                       forbid={"offload": True})
    assert not plan.fits and plan.infeasible["smallest_is_lower_bound"]
    assert "needs at least" in plan.infeasible["message"] and "model states alone" in plan.infeasible["message"]
    assert plan.infeasible["smallest_total_bytes"] == smallest
    assert plan.prediction["lower_bound"] and plan.prediction["total_bytes"] == smallest


def _brute_min(prof, pol, ctx, budget):
    """The report's smallest footprint as it was computed before the bounds: every head candidate simulated."""
    cands = candidates(dataclasses.replace(ctx, max_micro_batch=1), pol)

    def rank(s):  # the most saving extras level, then the memory-saving extremes; offload tried both ways
        return (-extras_saving(s), s.checkpointing.mode != "full" or s.checkpointing.num_blocks is not None,
                -s.chunked_ce, states_per_item(s.optimizer), not s.expandable_segments)

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
    ctx = search_context(prof, HW, 2, base, user_optimizer=False)
    shared = Estimates(prof, HW)
    for pol in [base] + [base.relaxed(a) for a in ALLOWANCES if a not in base.allow]:
        fast = min_footprint(prof, HW, pol, ctx, budget, shared)
        brute = _brute_min(prof, pol, ctx, budget)
        assert fast.strategy == brute.strategy
        assert fast.total_bytes == brute.total_bytes and fast.fits == brute.fits
        assert fast.estimate.to_dict() == brute.estimate.to_dict()
    assert len(shared.exact) < len(shared.quick)  # the bounds skipped some simulations


def test_first_fit_reach_fits_and_is_no_smaller_than_the_minimum(prof):
    """What allowing more would reach: the first fitting candidate (estimated exactly) when one fits, at least the
    policy's smallest total; the smallest itself when the likeliest candidate does not fit."""
    base = Policy.build()
    ctx = search_context(prof, HW, 2, base, user_optimizer=False)
    shared = Estimates(prof, HW)
    for pol in [base.relaxed("8bit_optimizer"), base.relaxed("lossy")]:
        smallest = min_footprint(prof, HW, pol, ctx, 40 * GB, shared)
        roomy = min_footprint(prof, HW, pol, ctx, 40 * GB, shared, first_fit=True)
        assert roomy.fits and not roomy.floor_only and roomy.total_bytes >= smallest.total_bytes
        assert roomy.strategy.precision != "fp32" and not roomy.strategy.activation_offload  # the likeliest
        tight = smallest.total_bytes + pol.margin(smallest.total_bytes) - 1  # nothing fits: the minimum
        assert min_footprint(prof, HW, pol, ctx, tight, shared, first_fit=True).total_bytes == smallest.total_bytes


def _no_floor(profile, s, hw, cache=None):
    from memopt.plan.floors import StateFloor

    return StateFloor(0, 0, 0, 0)


@pytest.mark.parametrize("budget", [1.0 * GB, 1.16 * GB, 1.3 * GB, 40 * GB])
def test_plans_are_the_same_without_the_state_floor(prof, monkeypatch, budget):
    """The search's floor prunes only what cannot fit: the plan is the same without it. Where nothing fits, the
    report without floors is exact, and a floor-only report is below it (a lower bound)."""
    with_floor = memopt.plan(SPEC, SAMPLE, budget=int(budget), hardware=HW, profile=prof, fidelity="lossy")
    monkeypatch.setattr(search_module, "state_floor", _no_floor)
    monkeypatch.setattr(footprint_module, "state_floor", _no_floor)
    monkeypatch.setattr(plan_build_module, "state_floor", _no_floor)
    without = memopt.plan(SPEC, SAMPLE, budget=int(budget), hardware=HW, profile=prof, fidelity="lossy")
    assert (with_floor.fits == without.fits and with_floor.strategy == without.strategy) or \
        with_floor.infeasible["smallest_is_lower_bound"]
    if with_floor.fits or not with_floor.infeasible["smallest_is_lower_bound"]:
        assert with_floor.prediction == without.prediction
        assert with_floor.infeasible == without.infeasible
    else:
        assert with_floor.total_bytes <= without.total_bytes
        assert with_floor.infeasible["smallest_total_bytes"] <= without.infeasible["smallest_total_bytes"]
    a, b = with_floor.search, without.search
    assert a["evaluated"] + a["pruned_as_too_big"] + a["pruned_as_slower"] == a["candidates"]
    assert a["evaluated"] <= b["evaluated"]
