"""The on-disk memo of estimates (memopt.estimate.store): a plan from stored estimates is the plan computed afresh."""

import json

import pytest

import memopt
import memopt.estimate.estimator as estimator_module
from memopt.estimate.estimator import estimate_strategy
from memopt.estimate.store import EstimateStore, estimate_from_json, estimate_to_json
from memopt.hardware import load_hardware
from memopt.models import with_overrides
from memopt.strategy import Checkpointing, Strategy

SPEC = with_overrides("tiny_llama", {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 512,
                                     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 40960})
SAMPLE = {"batch_size": 2, "seq_len": 64}
HW = load_hardware("h200")
GB = 10**9


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMOPT_CACHE_DIR", str(tmp_path))
    return tmp_path


def _plain(plan):
    d = plan.to_dict()
    d.pop("search")
    return d


def _counting(monkeypatch):
    calls = [0]
    simulate = estimator_module.simulate_allocator

    def counting(*args, **kwargs):
        calls[0] += 1
        return simulate(*args, **kwargs)

    monkeypatch.setattr(estimator_module, "simulate_allocator", counting)
    return calls


# infeasible on one GPU, with a report estimated (above its model-state floor); feasible. A cold profile equals a
# cached one (tests/profile/test_profile_cache.py), so the plan computed afresh here reuses the cached traces and
# computes every estimate again
@pytest.mark.parametrize("budget", [1.5 * GB, 40 * GB])
def test_a_plan_from_stored_estimates_equals_one_computed_afresh(cache, monkeypatch, budget):
    forbid = {"offload": True}
    first = memopt.plan(SPEC, SAMPLE, budget=int(budget), hardware=HW, forbid=forbid)
    assert first.fits or not first.infeasible["smallest_is_lower_bound"]
    stored = list((cache / "estimates").glob("*.json"))
    assert first.fits or (len(stored) == 1 and json.loads(stored[0].read_text())["entries"])
    calls = _counting(monkeypatch)
    again = memopt.plan(SPEC, SAMPLE, budget=int(budget), hardware=HW, forbid=forbid)
    if not first.fits:
        assert calls[0] == 0  # every replay of the report came from the store
    monkeypatch.setenv("MEMOPT_NO_ESTIMATE_CACHE", "1")
    fresh = memopt.plan(SPEC, SAMPLE, budget=int(budget), hardware=HW, forbid=forbid)
    assert calls[0] > 0  # computed, not read
    assert _plain(fresh) == _plain(first) == _plain(again)


def test_estimates_survive_the_round_trip(cache):
    prof = memopt.profile(SPEC, sample=SAMPLE, hardware=HW)
    for s in (Strategy(), Strategy(precision="bf16_autocast", checkpointing=Checkpointing(mode="full"),
                                   activation_offload=True, chunked_ce=8, expandable_segments=True)):
        for exact in (False, True):
            est = estimate_strategy(prof, s, hardware=HW, exact_reserved=exact, num_steps=2)
            back = estimate_from_json(json.loads(json.dumps(estimate_to_json(est))))
            assert back == est and back.to_dict() == est.to_dict()


def test_a_stale_store_is_ignored(cache):
    prof = memopt.profile(SPEC, sample=SAMPLE, hardware=HW)
    store = EstimateStore(prof)
    est = estimate_strategy(prof, Strategy(), hardware=HW, exact_reserved=False)
    store.put(Strategy(), HW, False, est)
    store.save()
    data = json.loads(store.path.read_text())
    assert EstimateStore(prof).get(Strategy(), HW, False) == est
    data["code"] = "something else"
    store.path.write_text(json.dumps(data))
    assert EstimateStore(prof).get(Strategy(), HW, False) is None
    uncached = memopt.profile(SPEC, sample=SAMPLE, hardware=HW, use_cache=False)
    assert EstimateStore(uncached).get(Strategy(), HW, False) is None
