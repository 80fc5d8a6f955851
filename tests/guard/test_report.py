"""python -m memopt.report RUN_DIR on a recorded CPU run (with an OOM), and the post-mortem's arithmetic."""

from __future__ import annotations

import json

from memopt.guard.escalation import step_down
from memopt.guard.faults import FaultInjector
from memopt.guard.memory import TrackedMemorySource
from memopt.guard.reapply import PreparedReplanner
from memopt.guard.report import STEP_CATEGORY, RunData, postmortem
from memopt.guard.runtime import RuntimeGuard
from memopt.report.__main__ import main
from memopt.step.prepare import prepare
from memopt.strategy import Strategy
from memopt.units import MiB

from ._helpers import batches, fake_plan, make_model

PNG = b"\x89PNG\r\n\x1a\n"


def _record_run(run_dir):
    model = make_model(seed=0)
    strategy = Strategy(micro_batch_size=4, grad_accum_steps=1, optimizer="adamw_foreach")
    prepared = prepare(model, strategy, device_type="cpu")
    source = TrackedMemorySource()
    injector = FaultInjector(at_attempt=3, phase="forward", after_ops=8)
    with source:
        source.track(model)
        plan = fake_plan(strategy, total=3 << 20, runtime=0, budget=4 << 20)  # about what the CPU run uses
        guard = RuntimeGuard(prepared.step, plan, run_dir=run_dir, memory=source,
                             record_modules=True,
                             replanner=PreparedReplanner(prepared, {"device_type": "cpu"}, step_down))
        guard.oom.phase_listeners.append(injector.on_phase)
        with guard, injector:
            for batch in batches(6):
                guard.step(batch)


def test_report_renders_from_a_recorded_run(tmp_path, capsys):
    run = tmp_path / "run"
    _record_run(run)
    assert main([str(run)]) == 0
    out = run / "report"
    for name in ("timeline.png", "categories.png", "modules.png"):
        assert (out / name).read_bytes()[:8] == PNG, name
        assert (out / name).stat().st_size > 10_000
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6
    assert len(summary["strategies"]) == 2 and summary["events"] == {"oom": 1, "replan": 1}
    first = summary["by_strategy"][summary["strategies"][0]]
    assert first["steps"] == 3 and first["measured_peak_allocated_bytes"] > 0
    assert first["predicted_peak_allocated_bytes"] == 3 * MiB - (3 * MiB) // 20
    [pm] = summary["postmortem"]
    assert pm["step"] == 3 and pm["phase"].startswith("forward")
    assert {r["category"] for r in pm["rows"]} >= {"parameters", "optimizer_states", STEP_CATEGORY}
    md = (out / "summary.md").read_text()
    assert "Predicted vs measured" in md and "Post-mortem" in md and "![timeline](timeline.png)" in md
    assert "OOM at step 3" in capsys.readouterr().out


def test_report_cli_rejects_a_directory_without_telemetry(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "not a memopt run directory" in capsys.readouterr().err


def test_postmortem_names_the_category_that_overran():
    breakdown = {"parameters": 2000, "optimizer_states": 4000, "gradients": 2000, "activations": 6000,
                 "temporaries": 1000, "allocator_overhead": 500, "runtime": 3000}
    event = {"kind": "oom", "step": 7, "attempt": 1, "phase": "backward[1]", "location": "before_optimizer",
             "strategy": "s", "rank": 0, "requested_bytes": 3000, "allocated_bytes": 15000, "reserved_bytes": 15800,
             "device_used_bytes": 19000, "needed_bytes": 18800 + 3200, "budget_bytes": 20000,
             "categories_bytes": {"parameters": 2000, "optimizer_states": 4000, "gradients": 1500},
             "predicted": {"total_bytes": 18500, "breakdown": breakdown, "peak_at": "step 1, optimizer step"}}
    run = RunData(run_dir=None, steps=[], events=[event], plan=None)
    [pm] = postmortem(run)
    rows = {r["category"]: r for r in pm["rows"]}
    assert rows[STEP_CATEGORY]["measured_bytes"] == 15000 + 3000 - 2000 - 4000
    assert rows[STEP_CATEGORY]["over_bytes"] == 12000 - 9000
    assert rows["allocator_overhead"]["over_bytes"] == 300
    assert rows["runtime"]["over_bytes"] == 200
    assert pm["culprit"] == STEP_CATEGORY
    assert "overran the plan by" in pm["verdict"]
