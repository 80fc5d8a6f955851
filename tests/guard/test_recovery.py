"""OOM recovery: injected OOMs in forward, backward and the optimizer step; exact continuation."""

from __future__ import annotations

import pytest
import torch

from memopt.guard.escalation import EscalationFailed, escalation_policy, step_down
from memopt.guard.faults import FaultInjector
from memopt.guard.oom import MemoptOOMError, OOMMeasurement, parse_oom_message
from memopt.guard.reapply import PreparedReplanner
from memopt.guard.recovery import OOMGuard
from memopt.step.prepare import prepare
from memopt.strategy import Checkpointing, Strategy

from ._helpers import batches, fake_plan, make_model, params_of

N_STEPS = 5
START = Strategy(micro_batch_size=4, grad_accum_steps=1, optimizer="adamw_foreach")


def _setup(strategy: Strategy = START, peak_at: str = "step 1, micro-batch 1, backward: head"):
    model = make_model(seed=0)
    prepared = prepare(model, strategy, device_type="cpu", optimizer_kwargs={"lr": 1e-2})
    plan = fake_plan(strategy, global_batch=4, peak_at=peak_at)
    replanner = PreparedReplanner(prepared, {"device_type": "cpu", "optimizer_kwargs": {"lr": 1e-2}}, step_down)
    return model, prepared, plan, replanner


def reference(switch_at: int, data, strategy: Strategy = START, switches: int = 1):
    """No error: run ``strategy`` and switch to the stepped-down plan(s) before step ``switch_at``."""
    model, prepared, plan, replanner = _setup(strategy)
    torch.manual_seed(1)
    step = prepared.step
    losses = []
    for i, batch in enumerate(data):
        if i == switch_at:
            for n in range(switches):
                plan = step_down(plan, None, n + 1)
                step = replanner.apply(plan.strategy)
        losses.append(step.step(batch))
    return params_of(model), losses, step


def guarded(data, injector: FaultInjector, *, strategy: Strategy = START, transaction: str = "auto",
            peak_at: str = "step 1, micro-batch 1, backward: head", max_escalations: int = 3):
    model, prepared, plan, replanner = _setup(strategy, peak_at)
    torch.manual_seed(1)
    guard = OOMGuard(prepared.step, plan, replanner=replanner, transaction=transaction,
                     max_escalations=max_escalations)
    guard.phase_listeners.append(injector.on_phase)
    losses = []
    with injector:
        for batch in data:
            losses.append(guard.run(batch))
    return params_of(model), losses, guard


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize(("phase", "after_ops", "transaction", "location"), [
    ("forward", 30, "auto", "before_optimizer"),  # after both dropout draws
    ("backward", 60, "auto", "before_optimizer"),  # some gradients already accumulated
    ("optimizer", 12, "always", "optimizer"),  # mid-update (foreach AdamW): restored from the pre-step copy
])
def test_oom_at_step_k_continues_exactly_like_a_switch_at_k(phase, after_ops, transaction, location):
    k = 2
    data = batches(N_STEPS)
    ref_params, ref_losses, ref_step = reference(k, data)
    injector = FaultInjector(at_attempt=k, phase=phase, after_ops=after_ops)
    params, losses, guard = guarded(data, injector, transaction=transaction)
    assert injector.fired and injector.fired[0][1].startswith(phase)
    # bitwise: the retry reruns the same batch with the RNG reset, and the rollback restores exact copies
    _assert_same(params, ref_params)
    assert losses == ref_losses
    assert guard.steps == N_STEPS and guard.step.steps_done == N_STEPS == ref_step.steps_done
    assert guard.step.strategy == ref_step.strategy and guard.step.strategy.micro_batch_size == 2
    assert guard.step.strategy.global_batch == 4
    [failure] = guard.report.failures
    assert failure.step == k and failure.attempt == 1 and failure.phase.startswith(phase)
    assert failure.location == location
    assert len(guard.report.replans) == 1


def test_oom_in_optimizer_state_init_needs_no_copy():
    # the first step creates the AdamW states before updating anything: an OOM there changed nothing
    data = batches(3)
    ref_params, ref_losses, _ = reference(0, data)
    injector = FaultInjector(at_attempt=0, phase="optimizer", after_ops=3)
    params, losses, guard = guarded(data, injector, transaction="never")
    assert guard.report.failures[0].location == "optimizer_state_init"
    _assert_same(params, ref_params)
    assert losses == ref_losses


def test_auto_copies_when_the_plan_peaks_in_the_optimizer_step():
    k = 1
    data = batches(3)
    ref_params, ref_losses, _ = reference(k, data)
    injector = FaultInjector(at_attempt=k, phase="optimizer", after_ops=12)
    params, losses, guard = guarded(data, injector, transaction="auto", peak_at="step 2, optimizer step")
    assert guard.transaction.snapshot_bytes > 0
    _assert_same(params, ref_params)
    assert losses == ref_losses


def test_partial_update_without_a_copy_is_not_retried():
    data = batches(3)
    injector = FaultInjector(at_attempt=1, phase="optimizer", after_ops=12)
    with pytest.raises(MemoptOOMError, match="partly applied") as err:
        guarded(data, injector, transaction="never")
    assert err.value.report.failures[0].location == "optimizer"
    assert not err.value.report.replans


def test_stops_after_max_escalations_with_the_step_undone():
    k = 1
    data = batches(3)
    before_k, _, _ = reference(99, data[:k])  # the parameters after k clean steps
    model, prepared, plan, replanner = _setup()
    torch.manual_seed(1)
    guard = OOMGuard(prepared.step, plan, replanner=replanner, max_escalations=2)
    injector = FaultInjector(at_attempt=k, phase="backward", after_ops=4, times=10)
    guard.phase_listeners.append(injector.on_phase)
    with injector, pytest.raises(MemoptOOMError, match="after 2 re-plan") as err:
        for batch in data:
            guard.run(batch)
    report = err.value.report
    assert len(report.failures) == 3 and len(report.replans) == 2
    assert [r["to"].split()[2] for r in report.replans] == ["mb=2x2", "mb=1x4"]
    assert guard.steps == k and guard.step.steps_done == k
    _assert_same(params_of(model), before_k)  # no half step: nothing of the failed step was applied


def test_escalation_that_reprepares_the_model():
    # micro-batch 1 cannot shrink: step_down turns on full checkpointing, which re-prepares the model
    start = Strategy(micro_batch_size=1, grad_accum_steps=4, optimizer="adamw_foreach")
    k = 1
    data = batches(3)
    ref_params, ref_losses, ref_step = reference(k, data, strategy=start)
    assert ref_step.strategy.checkpointing == Checkpointing(mode="full")
    injector = FaultInjector(at_attempt=k, phase="forward", after_ops=10)
    params, losses, guard = guarded(data, injector, strategy=start)
    assert guard.step.strategy.checkpointing == Checkpointing(mode="full")
    assert guard.step is not guard.report  # a new TrainStep object
    _assert_same(params, ref_params)
    assert losses == ref_losses


def test_step_down_order_and_end():
    plan = fake_plan(Strategy(micro_batch_size=4, grad_accum_steps=1), global_batch=4)
    seen = []
    for n in range(1, 6):
        try:
            plan = step_down(plan, None, n)
        except EscalationFailed:
            break
        seen.append([*plan.strategy.label().split()[1:3], "offload" if plan.strategy.activation_offload else ""])
    assert seen == [["ac=none", "mb=2x2", ""], ["ac=none", "mb=1x4", ""], ["ac=full", "mb=1x4", ""],
                    ["ac=full", "mb=1x4", "offload"]]


def test_escalation_policy_rules_out_the_failing_plan():
    plan = fake_plan(Strategy(), total=800 << 20, budget=1 << 30)
    m = OOMMeasurement(step=3, attempt=1, phase="backward[0]", location="before_optimizer", message="",
                       strategy=plan.strategy.label(), reserved_bytes=900 << 20, requested_bytes=200 << 20,
                       device_used_bytes=1000 << 20, predicted={"total_bytes": 800 << 20})
    assert m.needed_bytes == (1100 << 20) + (100 << 20)
    pol = escalation_policy(plan, m, 1)
    # what a new plan may predict: (budget - old margin) / ratio, ratio = 1200 / 800
    allowed = (1 << 30) - pol.margin(1 << 30)
    assert allowed == pytest.approx(((1 << 30) - plan.margin_bytes) / 1.5, rel=1e-6)
    assert allowed < plan.total_bytes
    # with nothing measured, each attempt still asks for less than the failing plan
    for attempt in (1, 2, 3):
        pol = escalation_policy(plan, None, attempt)
        assert (1 << 30) - pol.margin(1 << 30) <= plan.total_bytes - attempt * 0.1 * (700 << 20) + 1
    assert pol.allow == frozenset(plan.policy["allow"])


def test_parse_oom_message():
    msg = ("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.19 GiB of which "
           "3.06 MiB is free. Including non-PyTorch memory, this process has 79.18 GiB memory in use. Of the "
           "allocated memory 78.12 GiB is allocated by PyTorch, and 512.00 MiB is reserved by PyTorch but "
           "unallocated.")
    got = parse_oom_message(msg)
    assert got["requested_bytes"] == 20 << 20
    assert got["device_total_bytes"] == int(79.19 * (1 << 30))
    assert got["device_free_bytes"] == int(3.06 * (1 << 20))
    assert got["allocated_bytes"] == int(78.12 * (1 << 30))
    assert got["reserved_unallocated_bytes"] == 512 << 20
