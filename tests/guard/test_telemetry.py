"""Telemetry records, the progress string, and a guarded CPU run's files."""

from __future__ import annotations

import json

import torch

from memopt.guard.escalation import step_down
from memopt.guard.faults import FaultInjector
from memopt.guard.memory import SimulatedMemorySource, TrackedMemorySource
from memopt.guard.reapply import PreparedReplanner
from memopt.guard.runtime import RuntimeGuard
from memopt.guard.telemetry import Telemetry, format_progress
from memopt.step.prepare import prepare
from memopt.strategy import Strategy
from memopt.units import GiB, MiB, allocator_size

from ._helpers import batches, fake_plan, make_model


def test_records_and_progress_with_injected_figures(tmp_path):
    mem = SimulatedMemorySource(device_total_bytes=2 * GiB, outside_allocator_bytes=300 * MiB)
    plan = fake_plan(Strategy(micro_batch_size=4), total=900 * MiB, budget=GiB)
    tel = Telemetry(mem, plan=plan, run_dir=tmp_path, leaks=False)
    for step, (alloc, peak, reserved) in enumerate([(100, 500, 600), (120, 400, 600)]):
        tel.begin_step()
        mem.set(allocated=peak * MiB, reserved=reserved * MiB)
        mem.set(allocated=alloc * MiB)
        rec = tel.end_step(loss=torch.tensor(2.5 - step))
        assert rec["peak_allocated_bytes"] == peak * MiB  # the peak was reset when the step began
        assert rec["fragmentation_bytes"] == (reserved - alloc) * MiB
        assert rec["measured_total_bytes"] == (reserved + 300) * MiB
    tel.close()
    lines = (tmp_path / "telemetry.jsonl").read_text().splitlines()
    assert len(lines) == 2
    rec = json.loads(lines[1])
    assert rec["step"] == 1 and rec["loss"] == 1.5 and rec["attempts"] == 1
    for key in ("allocated_bytes", "reserved_bytes", "peak_allocated_bytes", "peak_reserved_bytes",
                "device_used_bytes", "device_total_bytes", "predicted_peak_allocated_bytes",
                "predicted_peak_reserved_bytes", "predicted_total_bytes", "budget_bytes"):
        assert isinstance(rec[key], int), key
    assert rec["predicted_total_bytes"] == 900 * MiB
    assert json.loads((tmp_path / "plan.json").read_text())["total_bytes"] == 900 * MiB
    assert tel.progress() == "mem 0.9/1.0 GiB (pred 0.9)"


def test_other_processes_on_the_device_are_not_this_runs_memory(tmp_path):
    """Beside other jobs on one GPU, the driver's used figure holds their memory too; the run's total (what the
    calibration learns from, what is compared with the plan's total) is its own: reserved + its own runtime."""
    mem = SimulatedMemorySource(device_total_bytes=80 * GiB, outside_allocator_bytes=300 * MiB,
                                other_processes_bytes=20 * GiB)
    tel = Telemetry(mem, plan=fake_plan(Strategy(micro_batch_size=4), total=900 * MiB, budget=GiB), run_dir=tmp_path,
                    leaks=False)
    tel.begin_step()
    mem.set(allocated=500 * MiB, reserved=600 * MiB)
    rec = tel.end_step(loss=torch.tensor(1.0))
    tel.close()
    assert rec["device_used_bytes"] == 20 * GiB + 900 * MiB  # the device as the driver sees it
    assert rec["process_used_bytes"] == 900 * MiB and rec["outside_allocator_bytes"] == 300 * MiB
    assert rec["measured_total_bytes"] == 900 * MiB


def test_format_progress():
    assert format_progress(int(31.2 * GiB), 40 * GiB, int(30.9 * GiB)) == "mem 31.2/40.0 GiB (pred 30.9)"
    assert format_progress(300 * MiB, None, None) == "mem 300.0 MiB"
    assert format_progress(None) == "mem n/a"


def test_runtime_guard_cpu_run_writes_telemetry_events_and_plans(tmp_path):
    model = make_model(seed=0)
    strategy = Strategy(micro_batch_size=4, grad_accum_steps=1, optimizer="adamw_foreach")
    prepared = prepare(model, strategy, device_type="cpu")
    plan = fake_plan(strategy)
    source = TrackedMemorySource()
    injector = FaultInjector(at_attempt=2, phase="backward", after_ops=5)
    with source:
        source.track(model)
        guard = RuntimeGuard(prepared.step, plan, run_dir=tmp_path, memory=source, record_modules=True,
                             replanner=PreparedReplanner(prepared, {"device_type": "cpu"}, step_down))
        guard.oom.phase_listeners.append(injector.on_phase)
        with guard, injector:
            for batch in batches(4):
                guard.step(batch)
                assert guard.progress().startswith("mem ")
    recs = [json.loads(line) for line in (tmp_path / "telemetry.jsonl").read_text().splitlines()]
    assert [r["attempts"] for r in recs] == [1, 1, 2, 1]
    assert recs[1]["strategy"] != recs[2]["strategy"] == recs[3]["strategy"]
    assert recs[3]["categories_bytes"]["parameters"] == sum(allocator_size(p.numel() * 4) for p in model.parameters())
    assert set(recs[3]["points_bytes"]) == {"step_start", "optimizer", "step_end"}
    assert any(name.startswith("blocks.") for name in recs[3]["modules_bytes"])
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["kind"] for e in events] == ["oom", "replan"]
    assert events[0]["phase"].startswith("backward") and events[0]["step"] == 2
    assert (tmp_path / "plans" / "plan_1.json").exists()
    assert guard.train_step.steps_done == 4


def test_without_a_memory_source_only_time_and_loss_are_recorded(tmp_path):
    tel = Telemetry(None, plan=fake_plan(Strategy()), run_dir=tmp_path) if not torch.cuda.is_available() else None
    if tel is None:
        return  # with a GPU the default source is CUDA's
    tel.begin_step()
    rec = tel.end_step(loss=3.0)
    tel.close()
    assert rec["loss"] == 3.0 and rec["step_time_s"] >= 0 and "peak_allocated_bytes" not in rec
    assert rec["predicted_total_bytes"] == 400 * MiB
    assert tel.progress() == "mem n/a"
