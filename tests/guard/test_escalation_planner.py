"""The default escalation, memopt.plan.make_plan on the same profile, in a real recovery (slow: profiling)."""

from __future__ import annotations

import pytest
import torch

from memopt.guard.escalation import PlanEscalator
from memopt.guard.faults import FaultInjector
from memopt.guard.reapply import PreparedReplanner
from memopt.guard.recovery import OOMGuard
from memopt.models import build_model, make_batch
from memopt.plan import make_plan
from memopt.profile.api import profile_model
from memopt.step.prepare import prepare

pytestmark = pytest.mark.slow


def test_plan_escalator_replans_on_the_same_profile_and_training_continues(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMOPT_CACHE_DIR", str(tmp_path))
    # activations large enough beside the runtime that a 10% smaller plan exists (at 8 x 32 the runtime is
    # nearly all of the total and no smaller plan does)
    sample = {"batch_size": 16, "seq_len": 128}
    torch.manual_seed(0)
    model = build_model("tiny_gpt2", device="cpu")
    prof = profile_model("tiny_gpt2", sample, hardware="h100_80gb")
    plan = make_plan(None, None, profile=prof, budget="2GiB", hardware="h100_80gb",
                     pins={"precision": "fp32", "attention": "math"})
    assert plan.fits and plan.global_batch == 16
    kwargs = {"device_type": "cpu"}
    prepared = prepare(model, plan.strategy, **kwargs)
    guard = OOMGuard(prepared.step, plan, replanner=PreparedReplanner(prepared, kwargs, PlanEscalator(prof)))
    injector = FaultInjector(at_attempt=1, phase="backward", after_ops=20)
    guard.phase_listeners.append(injector.on_phase)
    gen = torch.Generator().manual_seed(0)
    with injector:
        losses = [guard.run(make_batch("tiny_gpt2", sample, generator=gen)) for _ in range(3)]
    assert all(loss == loss for loss in losses)
    assert len(guard.report.replans) == 1
    new = guard.plan
    assert new.strategy != plan.strategy and new.fits
    assert new.total_bytes < plan.total_bytes  # the escalated plan asks for less
    assert new.strategy.global_batch == 16  # same global batch: micro-batching and accumulation
    # the running allocator mode, engine and training method stay (no adapters or quantization appear mid-run, no
    # offload engine: a running single-process step cannot become one; on the H200 an escalation that planned an
    # offload engine was refused for the allocator-mode pin it could not honour, with a traceback)
    assert new.policy["pins"] == {**plan.policy["pins"], "expandable_segments": plan.strategy.expandable_segments,
                                  "adapter_rank": 0, "quant_bits": 0, "offload": False}
    assert set(new.policy["allow"]) == set(plan.policy["allow"])  # no lossier technique than the user allowed
    assert any("re-planned after an out-of-memory error" in n for n in new.notes)
    assert guard.step.strategy == new.strategy and guard.step.steps_done == 3


def test_plan_escalator_plans_for_what_foreign_memory_leaves(tmp_path, monkeypatch):
    from memopt.guard.escalation import EscalationFailed
    from memopt.guard.oom import OOMMeasurement

    monkeypatch.setenv("MEMOPT_CACHE_DIR", str(tmp_path))
    sample = {"batch_size": 16, "seq_len": 128}  # activations ~50 MiB of a ~900 MiB total: smaller plans exist
    prof = profile_model("tiny_gpt2", sample, hardware="h100_80gb")
    plan = make_plan(None, None, profile=prof, budget="2GiB", hardware="h100_80gb",
                     pins={"precision": "fp32", "attention": "math"})
    budget = plan.budget_bytes
    foreign = budget - plan.total_bytes - plan.margin_bytes + (10 << 20)  # the running plan misses by 10 MiB

    def oom(foreign_bytes: int) -> OOMMeasurement:
        return OOMMeasurement(step=2, attempt=1, phase="forward[0]", location="before_optimizer", message="oom",
                              strategy=plan.strategy.label(), reserved_bytes=plan.peak_reserved_bytes + foreign_bytes,
                              requested_bytes=1 << 20, predicted={"total_bytes": plan.total_bytes},
                              budget_bytes=budget, foreign_bytes=foreign_bytes)

    new = PlanEscalator(prof)(plan, oom(foreign), 1)
    left = budget - foreign
    assert new.fits and new.budget_bytes == budget  # the cap stays the user's budget
    assert new.total_bytes + new.margin_bytes <= left < plan.total_bytes + plan.margin_bytes
    assert any("left of the" in n and "foreign memory" in n for n in new.notes)
    with pytest.raises(EscalationFailed):
        PlanEscalator(prof)(plan, oom(budget - (800 << 20)), 1)  # leaves less than plan and margin need
    with pytest.raises(EscalationFailed, match=r"100\.00 MiB"):  # a planner refusal is an escalation failure
        PlanEscalator(prof)(plan, oom(budget - (100 << 20)), 1)  # leaves less than the CUDA runtime alone
