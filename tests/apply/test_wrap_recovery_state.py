"""What a wrap holds after OOM recovery that did not end in a trained step: recovery gave up, was interrupted in the
retry, or the smaller plan failed to apply. The wrapper reads what is applied (``plan``, ``optimizer``, ``save``,
``unwrap``), nothing the user had is lost (training on, or resumed from a checkpoint, equals the plain loop), and
the random generators are back where the abandoned step began."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt
from memopt.guard.faults import FaultInjector

V, D = 256, 64
PINS = {"precision": "fp32", "optimizer": "adamw", "micro_batch_size": 4}
LR = 1e-2


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(self.norm(h))))


class _LM(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed, self.drop = nn.Embedding(V, D), nn.Dropout(dropout)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(D, V)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.drop(self.embed(input_ids))
        for block in self.blocks:
            h = block(h)
        return {"loss": F.cross_entropy(self.head(h).reshape(-1, V), labels.reshape(-1), ignore_index=-100)}


def _model(dropout: float = 0.0) -> _LM:
    torch.manual_seed(0)
    return _LM(dropout)


def _batch(i: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, V, (4, 32), generator=torch.Generator().manual_seed(100 + i))
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    return {"input_ids": ids, "labels": labels}


def _wrap(model: nn.Module, **kwargs: Any) -> Any:
    return memopt.wrap(model, budget="16GB", hardware="h100_80gb", sample=_batch(0), pins=PINS, lr=LR, **kwargs)


def _plain(n: int) -> nn.Module:
    """The unwrapped loop: AdamW over the same batches."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    for i in range(n):
        opt.zero_grad(set_to_none=True)
        model(**_batch(i))["loss"].backward()
        opt.step()
    return model


def _assert_same(model: nn.Module, ref: nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


def _inject(w: Any, **kwargs: Any) -> FaultInjector:
    injector = FaultInjector(**kwargs)
    w.guard.oom.phase_listeners.append(injector.on_phase)
    return injector


def _resumed(path: Any) -> Any:
    torch.manual_seed(1)
    w = _wrap(_LM())
    w.load(path)
    return w


def test_after_recovery_gives_up_the_wrapper_saves_and_unwraps_what_is_applied(tmp_path):
    w = _wrap(_model())
    before = w.plan.strategy
    with _inject(w, at_attempt=2, phase="backward", after_ops=3, times=100):
        for i in range(2):
            w.step(_batch(i))
        with pytest.raises(memopt.MemoptOOMError):
            w.step(_batch(2))  # re-planned, out of memory again: recovery gives up
    assert w.plan.strategy != before and w.plan is w.guard.plan  # the re-plan stays applied
    assert w.optimizer is w.guard.prepared.optimizer
    assert len(w.optimizer.state) == len(list(w.model.parameters()))  # two steps' Adam moments
    path = w.save(tmp_path / "ck.pt")
    resumed = _resumed(path)
    for i in range(2, 5):
        resumed.step(_batch(i))
    _assert_same(resumed.model, _plain(5))
    model = w.unwrap()
    assert all("forward" not in vars(block) for block in model.blocks)  # no checkpointed forward left behind


def test_an_interrupt_in_the_retry_leaves_the_wrapper_on_the_applied_plan(tmp_path):
    w = _wrap(_model())
    injector = _inject(w, at_attempt=2, phase="backward", after_ops=3)

    def ctrl_c(name: str) -> None:
        if injector.attempt == 3 and name == "forward[0]":
            raise KeyboardInterrupt

    w.guard.oom.phase_listeners.append(ctrl_c)
    with injector:
        for i in range(2):
            w.step(_batch(i))
        with pytest.raises(KeyboardInterrupt):
            w.step(_batch(2))
    w.guard.oom.phase_listeners.remove(ctrl_c)
    assert w.plan is w.guard.plan and w.optimizer is w.guard.prepared.optimizer
    path = w.save(tmp_path / "ck.pt")
    for i in range(2, 5):
        w.step(_batch(i))
    _assert_same(w.model, _plain(5))
    resumed = _resumed(path)
    for i in range(2, 5):
        resumed.step(_batch(i))
    _assert_same(resumed.model, _plain(5))


@pytest.mark.parametrize("error", [torch.OutOfMemoryError, KeyboardInterrupt])
def test_a_plan_that_fails_to_apply_puts_the_old_plan_and_its_state_back(error):
    calls = []

    def schedule(optimizer: torch.optim.Optimizer) -> Any:
        calls.append(len(calls))
        if len(calls) == 2:  # the re-plan's prepare: an OOM building the new pieces, or a Ctrl-C
            raise error("CUDA out of memory. Tried to allocate 2.00 MiB" if error is torch.OutOfMemoryError else "")
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    w = _wrap(_model(), lr_scheduler=schedule)
    before = w.plan.strategy
    with _inject(w, at_attempt=2, phase="backward", after_ops=3):
        for i in range(2):
            w.step(_batch(i))
        with pytest.raises(memopt.MemoptOOMError if error is torch.OutOfMemoryError else KeyboardInterrupt):
            w.step(_batch(2))
    assert len(calls) == 3  # the old plan prepared again
    assert w.plan.strategy == before and w.guard.oom.escalations == 0
    assert len(w.optimizer.state) == len(list(w.model.parameters()))
    for i in range(2, 5):
        w.step(_batch(i))
    _assert_same(w.model, _plain(5))


def test_a_step_abandoned_by_recovery_leaves_the_random_generators_at_its_start():
    def run(times: int) -> nn.Module:
        w = _wrap(_model(dropout=0.2))
        torch.manual_seed(123)
        injector = _inject(w, at_attempt=2, phase="backward", after_ops=3, times=times)
        with injector:
            for i in range(4):
                try:
                    w.step(_batch(i))
                except memopt.MemoptOOMError:
                    injector.enabled = False
                    w.step(_batch(i))  # the same batch again, as the error says
        return w.model

    _assert_same(run(times=100), run(times=0))
