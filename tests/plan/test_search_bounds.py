"""The search drops a candidate without tracing it when a lower bound of its step time is above the runners-up's.
A bound above a candidate's own estimate could drop the fastest plan, so each bound is checked against the estimate
of every candidate, and the host's share of the bound is checked to bind where the host is the limit (small models)."""

from __future__ import annotations

import pytest

import memopt
import memopt.plan.search as search_module
from memopt.estimate.estimator import estimate_strategy
from memopt.hardware import load_hardware
from memopt.models import with_overrides
from memopt.plan import Policy
from memopt.plan.context import search_context
from memopt.plan.search import candidates
from memopt.plan.search_bounds import optimistic_time, refined_time, twin_time
from tests.zoo.torch_patterns import PATTERNS

HW = load_hardware("h200")
SPEC = with_overrides("tiny_llama", {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                                     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512})
SAMPLE = {"batch_size": 2, "seq_len": 32}


def _llama():
    return memopt.profile(SPEC, sample=SAMPLE, hardware=HW, use_cache=False)


def _conv():
    """Convolutions, batch norm and pooling: ops of another kind than a transformer block's."""
    pattern = next(p for p in PATTERNS if p.name == "batchnorm")
    return memopt.profile(pattern.build(), pattern.sample(2), hardware=HW, use_cache=False)


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
    times, cache, host_bound = {}, {}, 0
    for s in cands:
        # the allocator mode changes neither bound nor the quick estimate's time
        if s.replace(expandable_segments=True) in times:
            continue
        s = s.replace(expandable_segments=True)
        est = estimate_strategy(prof, s, hardware=HW, exact_reserved=False)
        low, refined = optimistic_time(prof, s, HW, "amp", cache), refined_time(prof, s, HW, "amp", cache, 0.0)
        assert low <= refined <= est.step_time_s, (s.label(), low, refined, est.step_time_s)
        host_bound += refined > 2 * low
        times[s] = est.step_time_s
    # these models are bound by the host: the GPU-only bound is far below, the refined one is not
    assert host_bound > len(times) // 2
    # checkpointing and offload only add work: the plan without them bounds the plan with them
    twinned = 0
    for s, t in times.items():
        assert twin_time(s, times) <= t, s.label()
        twinned += twin_time(s, times) > 0
    assert twinned >= len(times) // 2


def test_the_refined_bounds_prune_without_changing_the_plan(monkeypatch):
    """The plan with the refined and twin bounds is the plan without them, found with fewer candidates traced."""
    prof = _llama()
    plan = memopt.plan(SPEC, SAMPLE, budget="40GB", hardware=HW, profile=prof, fidelity="lossy")
    monkeypatch.setattr(search_module, "refined_time", lambda *a, **k: 0.0)
    monkeypatch.setattr(search_module, "twin_time", lambda *a, **k: 0.0)
    without = memopt.plan(SPEC, SAMPLE, budget="40GB", hardware=HW, profile=prof, fidelity="lossy")
    assert plan.strategy == without.strategy and plan.prediction == without.prediction
    assert plan.runners_up == without.runners_up
    # what the pruned values lost by is said from their bounds: a value never traced is still explained
    assert "lower bound; not traced" in " ".join(plan.rejected.values())
    assert plan.search["evaluated"] < without.search["evaluated"] // 4
    assert plan.search["pruned_as_slower"] > without.search["pruned_as_slower"]



