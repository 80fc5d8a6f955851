"""The allocator replay skips micro-batches that repeat one another: the skip must never change what the replay
reports, and it must happen where a pass leaves the allocator as it found it."""

import random

import pytest

import memopt
from memopt.estimate.allocator import _repeat_marks, _replay, simulate_allocator
from memopt.estimate.allocator_config import AllocatorConfig
from memopt.estimate.allocator_sim import CachingAllocatorSim
from memopt.estimate.compose import pass_layout
from memopt.estimate.estimator import event_stream, static_bytes, step_plan
from memopt.hardware import load_hardware
from memopt.models import with_overrides
from memopt.strategy import Checkpointing, Strategy

MiB = 1 << 20


def _passes_stream(seed: int, m: int, steps: int) -> tuple[list, list, list[tuple[int, int]]]:
    """Persistent tensors, then per step a first micro-batch that keeps its gradients and ``m - 1`` that repeat
    one request pattern (fresh keys), then the gradients freed: the shape of a composed run."""
    rng = random.Random(seed)
    initial = [(1, k, rng.choice([3 * MiB, 40 * MiB, 700_000])) for k in range(6)]
    pattern = [rng.choice([512, 70_000, 900_000, 3 * MiB, 25 * MiB, 130 * MiB]) for _ in range(24)]
    order = list(range(len(pattern)))
    rng.shuffle(order)
    events: list = []
    passes: list[tuple[int, int]] = []
    key = 100
    for _ in range(steps):
        grads = []
        for mb in range(m):
            begin = len(events)
            mine = []
            for i, size in enumerate(pattern):
                key += 1
                events.append((1, key, size))
                mine.append((key, size))
                if i % 5 == 4:  # free some early, as a backward does
                    k, sz = mine.pop(0)
                    events.append((-1, k, sz))
            if mb == 0:
                grads = mine[:3]
                mine = mine[3:]
            for j in order:
                if j < len(mine):
                    events.append((-1, mine[j][0], mine[j][1]))
            for k, sz in [x for x in mine if (-1, x[0], x[1]) not in events[begin:]]:
                events.append((-1, k, sz))
            if mb > 0:
                passes.append((begin, len(events)))
        for k, sz in grads:
            events.append((-1, k, sz))
    return initial, events, passes


class _Counting(CachingAllocatorSim):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls = 0

    def malloc(self, key, size, stream=0):
        self.calls += 1
        return super().malloc(key, size, stream)


@pytest.mark.parametrize("expandable", [False, True])
@pytest.mark.parametrize("cap_fraction", [None, 0.8, 0.9, 0.99])
def test_skipping_repeated_passes_reports_the_same_as_replaying_them(expandable, cap_fraction):
    """Over random runs, uncapped and under caps that make the allocator flush and retry in some passes (where a
    pass changes the state and its repeat must be replayed: skipping every pass after the first fails here)."""
    config = AllocatorConfig(expandable_segments=expandable)
    for seed in range(40):
        initial, events, passes = _passes_stream(seed, m=6, steps=2)
        cap = None
        if cap_fraction is not None:
            full = simulate_allocator(events, config=config, initial_events=initial)
            cap = int(full.peak_reserved_bytes * cap_fraction) + sum(e[2] for e in initial)
        want = simulate_allocator(events, config=config, initial_events=initial, cap_bytes=cap)
        got = simulate_allocator(events, config=config, initial_events=initial, cap_bytes=cap, passes=passes)
        assert got == want, seed


def test_a_pass_that_leaves_the_allocator_unchanged_is_not_replayed_again():
    initial, events, passes = _passes_stream(3, m=8, steps=1)
    assert len(_repeat_marks(events, passes)) == 7
    plain, skipping = _Counting(), _Counting()
    for sim in (plain, skipping):
        for ev in initial:
            sim.malloc(ev[1], ev[2])
    _replay(plain, events)
    _replay(skipping, events, repeats=_repeat_marks(events, passes))
    per_pass = sum(1 for e in events[passes[0][0]:passes[0][1]] if e[0] > 0)
    # the first micro-batch, then repeats until one changes nothing: at most two, the rest skipped
    assert plain.calls - skipping.calls >= 4 * per_pass
    assert skipping.state_key() == plain.state_key()
    assert (skipping.peak_reserved_bytes, skipping.peak_allocated_bytes) == (plain.peak_reserved_bytes,
                                                                             plain.peak_allocated_bytes)


def test_passes_that_differ_or_keep_memory_are_never_skipped():
    a = [(1, 1, 4 * MiB), (-1, 1, 0)]
    b = [(1, 2, 4 * MiB), (-1, 2, 0)]
    c = [(1, 3, 6 * MiB), (-1, 3, 0)]
    keeps = [(1, 4, 4 * MiB)]
    assert _repeat_marks(a + b, [(0, 2), (2, 4)]) == {0: (0, 4), 2: (0, 4)}
    assert _repeat_marks(a + c, [(0, 2), (2, 4)]) == {}
    assert _repeat_marks(a + keeps, [(0, 2), (2, 3)]) == {}
    assert _repeat_marks([*a, (-1, 1, 0)], [(0, 2), (2, 3)]) == {}  # frees what it did not allocate


@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("ck", [Checkpointing(mode="full", num_blocks=3), Checkpointing(mode="none")],
                         ids=["full3", "none"])
def test_a_composed_run_replays_the_same_with_its_micro_batches_skipped(m, ck):
    spec = with_overrides("tiny_llama", {"num_hidden_layers": 6, "hidden_size": 256, "intermediate_size": 512,
                                         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048})
    prof = memopt.profile(spec, sample={"batch_size": 8, "seq_len": 128}, hardware=load_hardware("h200"),
                          use_cache=False)
    s = Strategy(precision="bf16_autocast", checkpointing=ck, micro_batch_size=8 // m, grad_accum_steps=m)
    sp = step_plan(prof, s)
    traces = {k: prof.variant(k, s.micro_batch_size) for k in sp.variants}
    layout = pass_layout(traces, sp.base, sp.block_modes, prof.full_block_counts)
    opt = prof.optimizer(s.precision, s.optimizer, traces[sp.base])
    _, static_events = static_bytes(prof, s, traces, sp.base, 8, opt.master_bytes)
    passes: list[tuple[int, int]] = []
    events, start = event_stream(traces, layout, s.micro_batch_size, m, opt, static_events, num_steps=2,
                                 passes=passes)
    rel = [(lo - start, hi - start) for lo, hi in passes]
    assert len(rel) == 2 * (m - 1)
    assert len(_repeat_marks(events[start:], rel)) == (2 * (m - 1) if m > 2 else 0)
    for expandable in (False, True):
        config = AllocatorConfig(expandable_segments=expandable)
        want = simulate_allocator(events[start:], config=config, initial_events=events[:start])
        got = simulate_allocator(events[start:], config=config, initial_events=events[:start], passes=rel)
        assert got == want
