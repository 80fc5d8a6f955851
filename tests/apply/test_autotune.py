"""Autotune: the measured choice among the planner's candidates leaves the user's model and RNG untouched,
picks the fastest measured score, and wrap records it in the plan's notes."""

import pytest
import torch

import memopt
from memopt.apply.autotune import autotune, candidate_pins, frontier, time_passes
from memopt.models import SampleSpec, build_model, make_batch, with_overrides
from memopt.plan.planner import make_plan

SAMPLE = {"batch_size": 8, "seq_len": 64}
SPEC = with_overrides("tiny_llama", {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
                                     "vocab_size": 1024})
KW = {"device_type": "cpu", "device": "cpu"}


def _plans(model):
    chosen = make_plan(model, SAMPLE, budget="16GB", hardware="h100_80gb")
    others = [make_plan(model, SAMPLE, budget="16GB", hardware="h100_80gb", pins=p)
              for p in candidate_pins(chosen, None)]
    return chosen, others


def test_candidates_cover_every_checkpointing_mode_with_the_chosen_settings():
    model = build_model(SPEC, device="cpu")
    chosen, others = _plans(model)
    modes = [p.strategy.checkpointing.mode for p in others]
    assert modes[:3] == ["none", "selective", "full"]
    # then the chosen plan's micro-batch neighbours, in its checkpointing mode
    micro = chosen.strategy.micro_batch_size
    neighbours = [p.strategy.micro_batch_size for p in others[3:]]
    assert set(neighbours) == {m for m in (2 * micro, micro // 2) if 1 <= m <= 8 and m != micro}
    assert set(modes[3:]) <= {chosen.strategy.checkpointing.mode}
    for p in others:
        assert p.strategy.optimizer == chosen.strategy.optimizer
        assert p.strategy.expandable_segments == chosen.strategy.expandable_segments
        assert p.strategy.activation_offload == chosen.strategy.activation_offload
    assert candidate_pins(chosen, {"checkpointing": "full"}) == []  # the user's pin is respected
    # the re-plans keep the chosen plan's activation-offload choice (each offloading re-plan traces once per
    # micro-batch size), unless the user pinned it
    assert all(p["activation_offload"] is chosen.strategy.activation_offload for p in candidate_pins(chosen, None))
    assert all(p["activation_offload"] is True
               for p in candidate_pins(chosen, {"activation_offload": True}))


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

    # every candidate measured: on this tiny, host-bound model the clock puts them more than 15% apart, and this test
    # is about training after the autotune, not about which candidates it measures
    real = at.frontier
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
    # the autotune's re-plans are not attributed (most are thrown away); the plan it keeps is, once
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
