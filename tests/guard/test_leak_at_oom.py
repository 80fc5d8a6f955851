"""At an OOM the guard first asks whether memory has been leaking: a fast leak is reported as a leak, not
re-planned; an OOM without growth history, or after clean steps whose memory varies, is re-planned as before.
Re-planned plans say whether their prediction was recomputed."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import torch

from memopt.guard.escalation import prediction_is_current, step_down
from memopt.guard.faults import FaultInjector, MemoryCap
from memopt.guard.leaks import LeakDetector, fast_growth
from memopt.guard.memory import TrackedMemorySource
from memopt.guard.oom import MemoptLeakError, MemoptOOMError, OOMMeasurement
from memopt.guard.reapply import PreparedReplanner
from memopt.guard.runtime import RuntimeGuard
from memopt.step.prepare import prepare
from memopt.strategy import Strategy

from ._helpers import fake_plan, make_batch, make_model, params_of

KiB = 1024
THRESHOLD = 8 * KiB  # the tiny model: a kept evaluation graph is ~800 KiB a step, logits 1 KiB per token
START = Strategy(micro_batch_size=4, grad_accum_steps=1, optimizer="adamw_foreach")
KWARGS = {"device_type": "cpu", "optimizer_kwargs": {"lr": 1e-2}}


class Session:
    """A tiny model trained through ``RuntimeGuard`` with real tensor accounting (``TrackedMemorySource``)."""

    def __init__(self, run_dir: Any = None, *, diagnose_leaks: bool = True, max_escalations: int = 3,
                 loss_fn: Any = None) -> None:
        self.model = make_model(seed=0)
        self.prepared = prepare(self.model, START, loss_fn=loss_fn, **KWARGS)
        self.plan = fake_plan(START, global_batch=4)
        self.source = TrackedMemorySource()
        self.run_dir = run_dir
        self.guard_kwargs = {"diagnose_leaks": diagnose_leaks, "max_escalations": max_escalations}
        self.guard: RuntimeGuard | None = None

    def __enter__(self) -> Session:
        self.source.__enter__()
        self.source.track(self.model)
        replanner = PreparedReplanner(self.prepared, dict(KWARGS), step_down)
        self.guard = RuntimeGuard(self.prepared.step, self.plan, run_dir=self.run_dir, memory=self.source,
                                  replanner=replanner, leak_threshold_bytes=THRESHOLD, calibrate=False,
                                  **self.guard_kwargs)
        self.guard.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.guard.__exit__(*exc)
        self.source.__exit__(*exc)

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.guard.telemetry.events if e["kind"] == kind]


def _leaking_run(session: Session, cap: MemoryCap | None, steps: int, kept: list) -> list[float]:
    """Train; after each step an evaluation pass without no_grad whose loss is kept (the GPU run's leak)."""
    losses = []
    if cap is not None:
        session.guard.oom.phase_listeners.append(cap.on_phase)
    for k in range(steps):
        if cap is not None:
            with cap:
                losses.append(session.guard.step(make_batch(4, 12, seed=k)))
        else:
            losses.append(session.guard.step(make_batch(4, 12, seed=k)))
        kept.append(session.model(**make_batch(8, 32, seed=500 + k))["loss"])
    return losses


def _cap_filled_by_step_3() -> tuple[int, int, list[torch.Tensor]]:
    """(cap, leak per step, parameters after 3 steps): a cap the leak fills during the fourth step (index 3),
    as on the H200, where the first step's growth (optimizer states) cannot count and two steps of growth are
    all there is."""
    kept: list = []
    with Session() as s:
        _leaking_run(s, None, 3, kept)
        recs = s.guard.telemetry.records
        params = params_of(s.model)
    start1, start2 = recs[1]["points_bytes"]["step_start"], recs[2]["points_bytes"]["step_start"]
    leak = start2 - start1
    extra = max(r["peak_allocated_bytes"] - r["points_bytes"]["step_start"] for r in recs[1:])
    assert leak > 4 * extra  # a fast leak: far more per step than the step itself needs
    return start1 + extra + leak * 3 // 2, leak, params


def test_fast_leak_at_oom_is_reported_as_a_leak_without_replanning(tmp_path):
    cap_bytes, leak, params_after_3 = _cap_filled_by_step_3()
    kept: list = []
    session = Session(tmp_path)
    cap = MemoryCap(session.source, cap_bytes, phases=("forward", "backward"))
    with session:
        with pytest.raises(MemoptLeakError) as err:
            _leaking_run(session, cap, 10, kept)
        _assert_leak_reported(session, cap, err.value, leak, params_after_3)
        # freeing what leaks lets the same batch be retried under the same plan
        kept.clear()
        loss = session.guard.step(make_batch(4, 12, seed=3))
        assert loss == loss and session.guard.oom.steps == 4 and session.prepared.step.steps_done == 4
    # the files: an oom, the leak (its fix included), the stop, and the report
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["kind"] for e in events] == ["oom", "leak", "stopped"]
    assert events[1]["at_oom"] and events[1]["cause"] == "graph_not_backpropagated" and "no_grad" in events[1]["fix"]
    assert json.loads((tmp_path / "oom_report.json").read_text())["leak"]["window"] == 2


def _assert_leak_reported(session: Session, cap: MemoryCap, err: MemoptLeakError, leak: int,
                          params_after_3: list[torch.Tensor]) -> None:
    guard = session.guard
    assert cap.fired and guard.oom.steps == 3  # three steps done, the fourth ran out of memory
    # no re-plan storm: nothing re-planned, the plan and the prepared model are the ones the run started with
    report = err.report
    assert report.replans == [] and len(report.failures) == 1
    assert guard.plan.strategy == START and guard.prepared is session.prepared
    assert session.prepared.step.steps_done == 3
    # the diagnosis: growth per step over the two steps after the first, the cause and its fix
    diag = err.leak
    assert diag["window"] == 2 and diag["cause"] == "graph_not_backpropagated"
    assert diag["growth_bytes_per_step"] == pytest.approx(leak, rel=0.02)
    message = str(err)
    assert "likely leak" in message and "over 2 steps" in message and "graph_not_backpropagated" in message
    assert "torch.no_grad()" in message and "did not re-plan" in message
    # the state is intact: the failed step changed nothing (the same parameters as after 3 clean steps)
    for a, b in zip(params_of(session.model), params_after_3):
        assert torch.equal(a, b)


def test_the_same_leak_without_the_diagnosis_is_a_replan_storm():
    # the contrast, so the test above has teeth: the same OOM is what the guard used to re-plan, repeatedly
    cap_bytes, _, _ = _cap_filled_by_step_3()
    kept: list = []
    session = Session(diagnose_leaks=False, max_escalations=2)
    cap = MemoryCap(session.source, cap_bytes, phases=("forward", "backward"))
    with session, pytest.raises(MemoptOOMError) as err:
        _leaking_run(session, cap, 10, kept)
    assert not isinstance(err.value, MemoptLeakError)
    assert len(err.value.report.replans) == 2 and err.value.report.leak is None
    assert "after 2 re-plan" in str(err.value)


def test_oom_without_growth_history_is_replanned_with_the_prediction_marked_stale(tmp_path):
    session = Session(tmp_path)
    injector = FaultInjector(at_attempt=1, phase="forward", after_ops=10, requested_bytes=1024)
    with session, injector:
        session.guard.oom.phase_listeners.append(injector.on_phase)
        for k in range(3):
            session.guard.step(make_batch(4, 12, seed=k))
    guard = session.guard
    assert injector.fired and guard.oom.steps == 3
    assert session.events("leak") == []
    [replan] = guard.oom.report.replans
    assert replan["to"].split()[2] == "mb=2x2"
    # step_down had no profile: the event says so instead of repeating the old plan's total as the new one's
    assert replan["prediction_recomputed"] is False and replan["predicted_total_bytes"] is None
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    [event] = [e for e in events if e["kind"] == "replan"]
    assert event["prediction_recomputed"] is False and event["predicted_total_bytes"] is None
    assert event["stale_predicted_total_bytes"] == session.plan.total_bytes
    assert "not recomputed" in event["prediction_note"] and START.label() in event["prediction_note"]
    records = guard.telemetry.records
    assert records[0]["predicted_total_bytes"] == session.plan.total_bytes
    assert records[1]["predicted_total_bytes"] is None and records[1]["prediction_recomputed"] is False
    assert not prediction_is_current(guard.plan)


def test_oom_after_50_clean_variable_length_steps_is_replanned():
    rng = random.Random(7)
    lengths = [rng.randint(4, 48) for _ in range(47)] + [8, 24, 40]  # it ends climbing, as a leak would
    assert max(lengths[:47]) > 40
    holder: dict = {}

    def loss_fn(out, batch):
        holder["last"] = out["logits"].detach()  # held between steps: memory varies with the input
        return out["loss"]

    session = Session(loss_fn=loss_fn)
    injector = FaultInjector(at_attempt=50, phase="forward", after_ops=10, requested_bytes=512)
    with session, injector:
        session.guard.oom.phase_listeners.append(injector.on_phase)
        for k, length in enumerate([*lengths, 16]):
            session.guard.step(make_batch(4, length, seed=k))
    guard = session.guard
    assert injector.fired and guard.oom.steps == 51
    assert session.events("leak") == [] and guard.telemetry.leaks.report is None
    assert len(guard.oom.report.replans) == 1 and guard.oom.report.leak is None
    starts = [v for s, v, _ in guard.telemetry.leaks.series["step_start"] if s <= 50]
    # teeth: the last steps alone grew steadily by more than the threshold; only the history (memory was that
    # high before) tells it from a leak
    assert fast_growth(starts[-3:], 2, THRESHOLD) is not None
    assert fast_growth(starts, 2, THRESHOLD) is None


# -- the rule on the H200 run's figures (benchmarks/guard/first_try/leak_eval4) -------------------------
GiB = 1 << 30
EVAL4_STEP_START = [1419292672, 5591956992, 6856647168, 8121337344]  # steps 0-3; step 3 ran out of memory
EVAL4_SAVED_UNUSED = [0, 1469772288, 2733691904, 3997611520]


def _eval4_oom(requested: int = 413138944) -> OOMMeasurement:
    return OOMMeasurement(step=3, attempt=1, phase="forward[0]", location="before_optimizer", message="",
                          strategy="mb=16x1", requested_bytes=requested, reserved_bytes=11932794880,
                          peak_reserved_bytes=11934892032, device_used_bytes=12736856064,
                          budget_bytes=12 * GiB)


def _eval4_detector() -> LeakDetector:
    detector = LeakDetector(warn=False)
    for step, (value, unused) in enumerate(zip(EVAL4_STEP_START, EVAL4_SAVED_UNUSED)):
        detector.observe(step, "step_start", value, {"census": True, "saved_unused_bytes": unused})
    assert detector.report is None  # the 5-step window rule has not seen enough steps
    return detector


def test_h200_eval4_history_is_a_leak_at_its_first_oom():
    oom = _eval4_oom()
    assert oom.shortfall_bytes == 413138944
    report = _eval4_detector().diagnose_oom(oom.shortfall_bytes)
    assert report is not None and report.window == 2
    assert report.growth_bytes_per_step == pytest.approx(1264690176, rel=1e-6)  # 1.18 GiB a step
    assert report.cause == "graph_not_backpropagated" and "no_grad" in report.fix


def test_growth_smaller_than_the_shortfall_is_left_to_the_replanner():
    # a step that asked for far more than the leak grew: the plan is too big, whatever leaks
    assert _eval4_detector().diagnose_oom(_eval4_oom(requested=8 * GiB).shortfall_bytes) is None


def test_fast_growth_rule():
    t = 100
    assert fast_growth([0, 150, 300], 2, t) == (150, 2)
    assert fast_growth([0, 100, 300, 500, 700], 2, t) == (175, 4)  # 100 is within a third of 200
    assert fast_growth([0, 150], 2, t) is None  # one step of growth is not a trend
    assert fast_growth([0, 150, 220], 2, t) is None  # the last change is noise-sized
    assert fast_growth([0, 1000, 1150], 2, t) is None  # one jump, then a small rise: not steady
    assert fast_growth([900, 0, 150, 300], 2, t) is None  # back to an earlier level: not a new high
    # an unsteady older change is dropped from the run rather than spoiling it
    assert fast_growth([0, 5000, 5200, 5400], 2, t) == (200, 2)
