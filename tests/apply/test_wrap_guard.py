"""wrap's runtime guard: telemetry in the run directory, and an OOM inside a step recovered by a re-plan."""

import json

import torch

import memopt
from memopt.models import SampleSpec, build_model, make_batch, with_overrides

SAMPLE = {"batch_size": 8, "seq_len": 256}
# activations large enough against the model states that a smaller plan exists
SPEC = with_overrides("tiny_llama", {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
                                     "vocab_size": 4096})


def test_wrap_writes_telemetry_and_recovers_from_an_injected_oom(tmp_path):
    from memopt.guard.faults import FaultInjector

    torch.manual_seed(0)
    w = memopt.wrap(build_model(SPEC, device="cpu"), budget="16GB", sample=SAMPLE, hardware="h100_80gb",
                    lr=1e-3, run_dir=tmp_path)
    batch = make_batch(SPEC, SampleSpec.parse(SAMPLE, SPEC))
    w.step(batch)
    before, before_total = w.plan.strategy, w.plan.total_bytes
    injector = FaultInjector(at_attempt=1, phase="backward", after_ops=5)
    w.guard.oom.phase_listeners.append(injector.on_phase)
    injector.attempt = 0  # the first step already ran
    with injector:
        loss = w.step(batch)  # OOM in backward: re-planned, the same batch retried
    assert isinstance(loss, float) and w.steps_done == 2
    assert w.plan.strategy != before
    w.close()
    lines = (tmp_path / "telemetry.jsonl").read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[-1])["attempts"] == 2  # the retried step is recorded once
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert any(e.get("kind") == "oom" for e in events)
    # wrap planned from a profile, so the re-plan (PlanEscalator) carries the planner's fresh prediction
    [replan] = [e for e in events if e.get("kind") == "replan"]
    assert replan["prediction_recomputed"] is True
    assert replan["predicted_total_bytes"] == w.plan.total_bytes != before_total
    assert json.loads(lines[-1])["predicted_total_bytes"] == w.plan.total_bytes
