"""Autotune: the measured choice among the planner's candidates leaves the user's model and RNG untouched,
picks the fastest measured score, and wrap records it in the plan's notes."""

import pytest
import torch

import memopt
from memopt.apply.autotune import autotune, frontier, time_passes
from memopt.models import SampleSpec, build_model, make_batch, with_overrides
from memopt.plan.planner import make_plan

SAMPLE = {"batch_size": 8, "seq_len": 64}
SPEC = with_overrides("tiny_llama", {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
                                     "vocab_size": 1024})
KW = {"device_type": "cpu", "device": "cpu"}


def _plans(model, **kw):
    chosen = make_plan(model, SAMPLE, budget="16GB", hardware="h100_80gb", alternatives_within=10.0, **kw)
    return chosen, chosen.alternatives


def _shape(plan):
    s = plan.strategy
    return s.checkpointing.mode, s.micro_batch_size, s.activation_offload


def test_alternatives_leave_the_plan_itself_unchanged():
    """The dry run (no autotune) and wrap on a GPU choose the same plan: the wider search only adds alternatives."""
    model = build_model(SPEC, device="cpu")
    plain = make_plan(model, SAMPLE, budget="16GB", hardware="h100_80gb")
    chosen, others = _plans(model)
    assert plain.alternatives == [] and others
    assert chosen.strategy == plain.strategy and chosen.prediction == plain.prediction
    assert chosen.runners_up == plain.runners_up
    assert "alternatives" not in chosen.to_dict()  # a saved plan is applied unchanged: nothing to measure


def test_alternatives_are_the_fastest_fitting_peer_of_each_shape_an_exhaustive_search_finds():
    """Every candidate of the policy estimated one by one (no pruning): the alternatives are the fastest fitting
    timing peers of the chosen plan, one per shape of step, as many as the limit, and none of them slower than the
    best of its shape."""
    from memopt.plan.context import resolve_policy, search_context
    from memopt.plan.evaluated import timing_peer
    from memopt.plan.search import candidates, evaluate
    from memopt.profile.api import profile_model

    model = build_model(SPEC, device="cpu")
    chosen, others = _plans(model)
    hw = memopt.load_hardware("h100_80gb")
    prof = profile_model(model, SAMPLE, hardware=hw)
    pol = resolve_policy(None)
    ctx = search_context(prof, hw, SAMPLE["batch_size"], pol, False)
    best: dict[tuple, float] = {}
    for s in candidates(ctx, pol):
        if not timing_peer(s, chosen.strategy):
            continue
        ev = evaluate(prof, s, hw, chosen.budget_bytes, chosen.margin_bytes)
        if ev.fits:
            shape = (s.checkpointing.mode, s.micro_batch_size, s.activation_offload)
            best[shape] = min(best.get(shape, float("inf")), ev.estimate.step_time_s)
    assert min(best.values()) >= chosen.step_time_s * 0.999  # the chosen plan is the fastest of them all
    expected = sorted((t, shape) for shape, t in best.items() if shape != _shape(chosen))[:3]
    assert len(others) == len(expected) == 3
    assert {_shape(p) for p in others} == {shape for _, shape in expected}
    for p in others:
        assert timing_peer(p.strategy, chosen.strategy) and p.fits
        assert p.step_time_s <= best[_shape(p)] * 1.0001  # a bisected block count can only be faster
        # should the autotune keep it, its runners-up are the planner's choice and the other alternatives
        assert [r["label"] for r in p.runners_up] == [q.strategy.label() for q in [chosen, *others] if q is not p]


def test_alternatives_keep_the_users_pins():
    model = build_model(SPEC, device="cpu")
    chosen, others = _plans(model, pins={"checkpointing": "full"})
    assert others and all(p.strategy.checkpointing.mode == "full" for p in others)
    chosen, others = _plans(model, pins={"micro_batch_size": 2})
    assert all(p.strategy.micro_batch_size == 2 for p in [chosen, *others])


def test_autotune_picks_the_fastest_score_and_leaves_the_model_untouched():
    torch.manual_seed(0)
    model = build_model(SPEC, device="cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = make_batch(SPEC, SampleSpec.parse(SAMPLE, SPEC))
    chosen, others = _plans(model)
    fake_seconds = {"none": 0.3, "selective": 0.1, "full": 0.2}
    calls = []

    def timer(m, prepared, b):
        calls.append(prepared.step.strategy.label())
        # the prepared model really runs: one forward+backward
        loss = prepared.step.loss(b)
        loss.backward()
        return fake_seconds[prepared.step.strategy.checkpointing.mode]

    rng = torch.get_rng_state()
    best, trials = autotune(model, [chosen, *others], batch, KW, timer=timer)
    labels = {t.plan.strategy.label() for t in trials}
    assert len(labels) == len(trials) == len(calls)  # each distinct candidate measured once
    opt = {t.plan.strategy.label(): float(t.plan.prediction.get("optimizer_s", 0)) for t in trials}
    assert best.strategy.label() == min(trials, key=lambda t: t.score_s).plan.strategy.label()
    for t in trials:
        expected = fake_seconds[t.plan.strategy.checkpointing.mode] + opt[t.plan.strategy.label()]
        assert abs(t.score_s - expected) < 1e-12
    assert torch.equal(torch.get_rng_state(), rng)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())
    assert type(model.model.layers[0]).__name__ == type(build_model(SPEC, device="meta").model.layers[0]).__name__


@pytest.mark.slow
def test_wrap_with_autotune_trains_the_same_as_its_chosen_plan(monkeypatch):
    import memopt.apply.autotune as at
    import memopt.apply.wrapped as wrapped

    # every candidate measured: on this tiny, host-bound model the clock puts them more than 15% apart, and this test
    # is about training after the autotune, not about which candidates it measures
    real = at.frontier
    monkeypatch.setattr(wrapped, "ALTERNATIVES_WITHIN", 10.0)
    monkeypatch.setattr(at, "frontier", lambda chosen, others: real(chosen, others, tolerance=10.0))
    import memopt.estimate.attribution as attribution

    attributed = []
    real_attach = attribution.attach_to_plan
    monkeypatch.setattr(attribution, "attach_to_plan",
                        lambda plan, *a: (attributed.append(plan), real_attach(plan, *a))[1])
    torch.manual_seed(0)
    model = build_model(SPEC, device="cpu")
    init = {k: v.clone() for k, v in model.state_dict().items()}
    batches = [make_batch(SPEC, SampleSpec.parse(SAMPLE, SPEC), generator=torch.Generator().manual_seed(i))
               for i in range(3)]
    w = memopt.wrap(model, budget="16GB", sample=SAMPLE, hardware="h100_80gb", lr=1e-3, autotune=True, guard=False)
    losses = [w.step(b) for b in batches]
    assert any(n.startswith("autotune measured") for n in w.plan.notes)
    assert len(w.autotune_trials) >= 2 and w.steps_done == 3
    # the alternatives are not attributed (most are thrown away); the plan it keeps is, once
    assert "attribution" in w.plan.prediction
    assert len(attributed) <= 2 and attributed[-1] is w.plan
    chosen = w.plan
    w.unwrap()
    # the same plan applied unchanged from the same initial weights gives the same losses: autotune changed nothing
    torch.manual_seed(0)
    ref_model = build_model(SPEC, device="cpu")
    ref_model.load_state_dict(init)
    ref = memopt.wrap(ref_model, plan=chosen, lr=1e-3, guard=False)
    ref_losses = [ref.step(b) for b in batches]
    assert losses == ref_losses


def test_frontier_keeps_what_the_clock_cannot_tell_apart():
    model = build_model(SPEC, device="cpu")
    chosen, others = _plans(model)
    kept = frontier(chosen, others, tolerance=0.15)
    assert kept[0] is chosen
    labels = [p.strategy.label() for p in kept]
    assert len(labels) == len(set(labels))  # distinct
    assert all(p.step_time_s <= chosen.step_time_s * 1.15 for p in kept[1:])
    dropped = [p for p in others if p.strategy.label() not in labels]
    assert all(p.step_time_s > chosen.step_time_s * 1.15 or p.strategy.label() == chosen.strategy.label()
               for p in dropped)
    assert frontier(chosen, others, tolerance=10.0)[1:] == sorted(
        {p.strategy.label(): p for p in others if p.strategy.label() != chosen.strategy.label()}.values(),
        key=lambda p: p.step_time_s)



def test_frontier_measures_only_plans_of_the_chosen_plans_engine():
    """A ZeRO-2 offload candidate that the re-plan made beside a one-GPU choice is not measured through the one-GPU
    step, which would keep its gradients and optimizer states on the GPU (a falcon-shaped 1.1B at 24 GiB ran out of
    memory there, while its engine fits)."""
    import dataclasses

    from memopt.techniques.sharding import ShardingSetting

    model = build_model(SPEC, device="cpu")
    chosen, others = _plans(model)
    near = min((p for p in others if p.strategy.label() != chosen.strategy.label()), key=lambda p: p.step_time_s)
    offload = ShardingSetting(engine="deepspeed", stage=2, offload_optimizer="cpu")
    sharded = dataclasses.replace(near, strategy=dataclasses.replace(
        near.strategy, extras=tuple(sorted({**dict(near.strategy.extras), "sharding": offload}.items()))))
    assert sharded.strategy.extra("sharding") is offload and sharded.fits
    labels = [p.strategy.label() for p in frontier(chosen, [sharded, near], tolerance=10.0)]
    assert labels == [chosen.strategy.label(), near.strategy.label()]
    # from a sharded choice, the one-GPU plans are the other engine
    assert [p.strategy.label() for p in frontier(sharded, [chosen, near], tolerance=10.0)] == [
        sharded.strategy.label()]

def test_autotune_stops_measuring_when_its_time_is_spent():
    model = build_model(SPEC, device="cpu")
    batch = make_batch(SPEC, SampleSpec.parse(SAMPLE, SPEC))
    chosen, others = _plans(model)
    plans = frontier(chosen, others, tolerance=10.0)
    assert len(plans) >= 3
    now = [0.0]

    def timer(m, prepared, b):
        now[0] += 15.0  # every measurement costs 15 s of the 20 s budget
        return 1.0

    best, trials = autotune(model, plans, batch, KW, timer=timer, time_budget_s=20.0, clock=lambda: now[0])
    measured = [t for t in trials if t.score_s is not None]
    assert len(measured) == 2  # the first two started before 20 s had passed
    assert best.strategy.label() == plans[0].strategy.label()  # equal scores: the planner's choice
    assert all("not measured" in t.error for t in trials if t.score_s is None)
    assert len(trials) == len(plans)


def test_time_passes_scales_a_prefix_of_equal_micro_batches():
    model = build_model(SPEC, device="cpu")
    batch = make_batch(SPEC, SampleSpec.parse(SAMPLE, SPEC))
    plan = make_plan(model, SAMPLE, budget="16GB", hardware="h100_80gb", pins={"micro_batch_size": 1})
    from memopt.step.prepare import prepare

    prepared = prepare(model, plan.strategy, **KW)
    try:
        ticks = []

        def sync():
            ticks.append(len(ticks))

        swept = []
        real_loss = prepared.step.loss

        def counting_loss(mb):
            swept.append(1)
            return real_loss(mb)

        prepared.step.loss = counting_loss
        time_passes(model, prepared, batch, repeats=2, sync=sync, max_micro_batches=3)
        assert len(swept) == 2 * 3  # three of the eight micro-batches, twice
    finally:
        prepared.undo()


def test_startup_counts_from_wrap_to_the_start_of_the_first_step():
    import time

    model = build_model(SPEC, device="cpu")
    batch = make_batch(SPEC, SampleSpec.parse(SAMPLE, SPEC))
    t0 = time.perf_counter()
    w = memopt.wrap(model, budget="16GB", sample=SAMPLE, hardware="h100_80gb", lr=1e-3, guard=False)
    wrapped_s = time.perf_counter() - t0
    assert w.startup_s is None  # nothing trained yet
    w.step(batch)
    first_end_s = time.perf_counter() - t0
    startup = w.startup_s
    assert wrapped_s <= startup <= first_end_s
    w.step(batch)
    assert w.startup_s == startup


def test_a_load_before_the_first_step_survives_the_autotune(monkeypatch, tmp_path):
    """A resume (wrap, load, step) with the autotune on trains on from the checkpoint: the optimizer state, step
    count and schedule carry into the plan the autotune keeps, as in an uninterrupted run."""
    import memopt.apply.autotune as at
    import memopt.apply.wrapped as wrapped

    real = at.frontier
    monkeypatch.setattr(wrapped, "ALTERNATIVES_WITHIN", 10.0)  # candidates to measure on this tiny model
    monkeypatch.setattr(at, "frontier", lambda chosen, others: real(chosen, others, tolerance=10.0))
    batches = [make_batch(SPEC, SampleSpec.parse(SAMPLE, SPEC), generator=torch.Generator().manual_seed(i))
               for i in range(4)]

    def schedule(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))

    def wrap(autotune, seed=0):
        torch.manual_seed(seed)
        return memopt.wrap(build_model(SPEC, device="cpu"), budget="16GB", sample=SAMPLE, hardware="h100_80gb",
                           pins={"precision": "fp32", "optimizer": "adamw"}, lr=1e-3, lr_scheduler=schedule,
                           autotune=autotune, guard=False)

    ref = wrap(autotune=False)
    for b in batches[:2]:
        ref.step(b)
    path = ref.save(tmp_path / "ck.pt")
    for b in batches[2:]:
        ref.step(b)
    resumed = wrap(autotune=True, seed=1)
    resumed.load(path)
    for b in batches[2:]:
        resumed.step(b)
    assert len(resumed.autotune_trials) >= 2  # the autotune ran, and re-applied the plan it kept
    assert resumed.steps_done == 4 and resumed.lr_scheduler.last_epoch == ref.lr_scheduler.last_epoch
    assert [s["step"] for s in resumed.optimizer.state.values()] == [s["step"] for s in ref.optimizer.state.values()]
    for (name, p), q in zip(resumed.model.named_parameters(), ref.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=name)  # the plan kept may split the batch: rounding, no more
