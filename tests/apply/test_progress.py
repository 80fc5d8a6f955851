"""Progress on the terminal while ``memopt.wrap`` works before the first step (``memopt.progress``): one line per
stage, in order, with the seconds since the work began; shown on a terminal or with ``MEMOPT_PROGRESS=1``, never with
``MEMOPT_PROGRESS=0``; silent once training runs."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import memopt
from memopt import progress
from memopt.apply.autotune import autotune

LINE = re.compile(r"^memopt \[ *\d+\.\ds\] (.+)$")


def _loss(out, batch):
    return nn.functional.cross_entropy(out, batch[1])


def _wrap_and_train(steps: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    w = memopt.wrap(model, budget="8GB", hardware="h200", sample=batch, loss_fn=_loss, use_cache=False)
    for _ in range(steps):
        w.step(batch)
    return w


def _lines(err: str) -> list[str]:
    out = []
    for line in err.splitlines():
        m = LINE.match(line)
        if m:
            out.append(m.group(1))
    return out


def test_each_stage_has_its_line_in_order_and_training_is_silent(monkeypatch, capsys):
    monkeypatch.setenv("MEMOPT_PROGRESS", "1")
    w = _wrap_and_train(1)
    planning = _lines(capsys.readouterr().err)
    assert planning[0].startswith("profiling Sequential for h200")
    traced = [x for x in planning if x.startswith("traced ")]
    assert traced and all(re.search(r"in \d+\.\d s$", x) for x in traced)
    assert planning[-2].startswith(f"planned: {w.plan.strategy.label()} (predicted ")
    assert planning[-1] == f"first step trained: {w.plan.strategy.label()}"
    w.step((torch.randn(8, 16), torch.randint(0, 4, (8,))))
    assert _lines(capsys.readouterr().err) == []  # the work is over: steps print nothing


@pytest.mark.parametrize("setting", ["0", ""])
def test_off_unless_asked_or_on_a_terminal(monkeypatch, capsys, setting):
    monkeypatch.setenv("MEMOPT_PROGRESS", setting)  # "": pytest's captured stderr is not a terminal
    _wrap_and_train(1)
    assert _lines(capsys.readouterr().err) == []


def test_a_terminal_shows_it_by_default(monkeypatch):
    monkeypatch.delenv("MEMOPT_PROGRESS", raising=False)

    class Terminal:
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr("sys.stderr", Terminal())
    assert progress.enabled()
    monkeypatch.setenv("MEMOPT_PROGRESS", "0")
    assert not progress.enabled()


def test_the_autotune_reports_each_measured_candidate(monkeypatch, capsys):
    monkeypatch.setenv("MEMOPT_PROGRESS", "1")
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    plans = [memopt.plan(model, batch, budget="8GB", hardware="h200", loss_fn=_loss, use_cache=False, pins=pins)
             for pins in ({"precision": "fp32"}, {"precision": "bf16_autocast"})]
    seconds = iter([0.25, 0.5])

    def timer(m, prepared, b):
        return next(seconds)

    progress.start("autotune test")
    autotune(model, plans, batch, {"device_type": "cpu", "device": "cpu", "loss_fn": _loss}, timer=timer)
    progress.done("over")
    lines = _lines(capsys.readouterr().err)
    measured = [x for x in lines if x.startswith("autotune: ")]
    assert [x.split(": ")[1] for x in measured] == [p.strategy.label() for p in plans]
    assert measured[0].startswith(f"autotune: {plans[0].strategy.label()}: 0.25")
    assert lines[-1] == "over"


def test_a_profile_made_on_its_own_stays_quiet(monkeypatch, capsys):
    monkeypatch.setenv("MEMOPT_PROGRESS", "1")
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    memopt.plan(model, (torch.randn(8, 16), torch.randint(0, 4, (8,))), budget="8GB", hardware="h200",
                loss_fn=_loss, use_cache=False)
    assert _lines(capsys.readouterr().err) == []
