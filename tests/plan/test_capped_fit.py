"""Plans that fit under the hard cap memopt.wrap sets: the caching allocator flushes its cache and retries there
instead of growing its reserved bytes past the cap, so a candidate whose uncapped reserved peak is over the budget
can still train (measured: bert-large at 12 GiB on the H200). The planner replays those under the cap."""

import pytest

import memopt
from memopt.estimate.allocator import simulate_allocator
from memopt.estimate.allocator_config import AllocatorConfig
from memopt.estimate.estimator import CappedOOM, estimate_strategy
from memopt.hardware import load_hardware
from memopt.models import with_overrides
from memopt.plan.search import _under_cap, evaluate
from memopt.strategy import Checkpointing, Strategy

SPEC = with_overrides("tiny_llama", {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 512,
                                     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048})
SAMPLE = {"batch_size": 8, "seq_len": 256}
HW = load_hardware("h200")
MiB = 1 << 20
S = Strategy(precision="bf16_autocast", checkpointing=Checkpointing(mode="none"), micro_batch_size=8,
             grad_accum_steps=1, optimizer="adamw_fused", expandable_segments=False)


@pytest.fixture(scope="module")
def prof():
    return memopt.profile(SPEC, sample=SAMPLE, hardware=HW, use_cache=False)


def test_the_capped_replay_is_the_allocator_under_the_cap(prof):
    free = estimate_strategy(prof, S, hardware=HW, num_steps=2)
    assert free.peak_reserved_bytes > free.peak_allocated_bytes + 4 * MiB  # the default allocator caches blocks
    cap = free.peak_reserved_bytes - 2 * MiB  # just below: the allocator must flush its cache once
    capped = estimate_strategy(prof, S, hardware=HW, num_steps=2, cap_bytes=cap)
    assert capped.peak_allocated_bytes == free.peak_allocated_bytes
    assert capped.peak_reserved_bytes <= cap < free.peak_reserved_bytes
    assert capped.detail["capped"]["alloc_retries_per_step"] >= 1
    assert capped.step_time_s > free.step_time_s  # the retries cost time
    with pytest.raises(CappedOOM):  # below the allocated peak nothing can serve it
        estimate_strategy(prof, S, hardware=HW, num_steps=2, cap_bytes=free.peak_allocated_bytes - 4 * MiB)


def test_a_candidate_over_budget_uncapped_fits_under_the_cap(prof):
    free = estimate_strategy(prof, S, hardware=HW, num_steps=2)
    margin = 0
    budget = free.peak_reserved_bytes - 2 * MiB + free.runtime_bytes
    uncapped = evaluate(prof, S, HW, budget, margin)
    assert uncapped.fits is False
    ev = _under_cap(prof, S, HW, budget, margin, uncapped)
    assert ev.fits and ev.total_bytes <= budget
    # the same replay, by hand: the simulator under the cap never runs out
    from memopt.estimate.compose import pass_layout
    from memopt.estimate.estimator import event_stream, static_bytes, step_plan

    sp = step_plan(prof, S)
    traces = {k: prof.variant(k, 8) for k in sp.variants}
    layout = pass_layout(traces, sp.base, sp.block_modes, prof.full_block_counts)
    opt = prof.optimizer(S.precision, S.optimizer, traces[sp.base])
    _, static_events = static_bytes(prof, S, traces, sp.base, 8, opt.master_bytes)
    events, start = event_stream(traces, layout, 8, 1, opt, static_events, num_steps=2)
    res = simulate_allocator(events[start:], config=AllocatorConfig(expandable_segments=False),
                             initial_events=events[:start], cap_bytes=budget - free.runtime_bytes)
    assert not res.oom and res.peak_reserved_bytes == ev.estimate.peak_reserved_bytes
    # under a cap below the allocated peak it stays over budget
    tight = free.peak_allocated_bytes + free.runtime_bytes - 4 * MiB
    assert _under_cap(prof, S, HW, tight, margin, evaluate(prof, S, HW, tight, margin)).fits is False
