"""Autotune: the measured choice among the planner's candidates leaves the user's model and RNG untouched,
picks the fastest measured score, and wrap records it in the plan's notes."""

import pytest
import torch

import memopt
from memopt.apply.autotune import autotune, candidate_pins
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
    assert [p.strategy.checkpointing.mode for p in others] == ["none", "selective", "full"]
    for p in others:
        assert p.strategy.optimizer == chosen.strategy.optimizer
        assert p.strategy.expandable_segments == chosen.strategy.expandable_segments
    assert candidate_pins(chosen, {"checkpointing": "full"}) == []  # the user's pin is respected


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
def test_wrap_with_autotune_trains_the_same_as_its_chosen_plan():
    torch.manual_seed(0)
    model = build_model(SPEC, device="cpu")
    init = {k: v.clone() for k, v in model.state_dict().items()}
    batches = [make_batch(SPEC, SampleSpec.parse(SAMPLE, SPEC), generator=torch.Generator().manual_seed(i))
               for i in range(3)]
    w = memopt.wrap(model, budget="16GB", sample=SAMPLE, hardware="h100_80gb", lr=1e-3, autotune=True, guard=False)
    losses = [w.step(b) for b in batches]
    assert any(n.startswith("autotune measured") for n in w.plan.notes)
    assert len(w.autotune_trials) >= 2 and w.steps_done == 3
    chosen = w.plan
    w.unwrap()
    # the same plan applied unchanged from the same initial weights gives the same losses: autotune changed nothing
    torch.manual_seed(0)
    ref_model = build_model(SPEC, device="cpu")
    ref_model.load_state_dict(init)
    ref = memopt.wrap(ref_model, plan=chosen, lr=1e-3, guard=False)
    ref_losses = [ref.step(b) for b in batches]
    assert losses == ref_losses
