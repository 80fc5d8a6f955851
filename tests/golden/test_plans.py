"""Behaviour unchanged: the plans of the record (``plans.json``, written by ``python -m tests.golden.record record``)
are what this tree plans, field for field (strategy, peaks by category, step time, runners-up, rejections, notes).

CI plans every pattern, one zoo family per task and, at their two tighter budgets, the configs that took at most
``CHEAP_S`` seconds when recorded;
``python -m tests.golden.record check`` plans all of them (every zoo family, the large configs, the recipes)."""

from __future__ import annotations

import json

import pytest

from tests.golden.record import RECORD, cases, differences, digest, plan_record

CHEAP_S = 8.0
ROOMY = "80GB"  # a shipped config's roomiest budget: its plans are the least searched, so CI plans the other two
RECORDED = json.loads(RECORD.read_text())["cases"]
FIRST_OF_TASK = {}
for _case in cases():
    if _case.group == "zoo":
        FIRST_OF_TASK.setdefault(_case.name.split(":")[0], _case.name)
CHEAP = [c for c in cases() if c.id in RECORDED and (
    c.group == "pattern" or (c.group == "zoo" and c.name in FIRST_OF_TASK.values())
    or (c.group == "config" and RECORDED[c.id]["plan_s"] <= CHEAP_S and c.budget != ROOMY))]


def test_the_record_covers_every_case_and_each_group():
    ids = {c.id for c in cases()}
    assert ids == set(RECORDED), sorted(ids ^ set(RECORDED))
    groups = {c.group for c in cases()}
    assert groups == {"config", "recipe", "zoo", "pattern"}
    assert {c.group for c in CHEAP} >= {"config", "zoo", "pattern"} and len(FIRST_OF_TASK) == 6
    assert sum("sha256" in r for r in RECORDED.values()) > 0.9 * len(RECORDED)  # plans, not a list of errors


def test_a_changed_plan_is_reported():
    plan = {"fits": True, "strategy_label": "fp32 ac=none", "step_time_s": 0.25, "runners_up": [{"label": "a"}],
            "search": {"seconds": 1.0}}
    rec = digest(plan)
    assert differences({"c": rec}, {"c": digest({**plan, "search": {"seconds": 2.0}})}) == []  # wall clock only
    slower = differences({"c": rec}, {"c": digest({**plan, "step_time_s": 0.25 * (1 + 1e-12)})})
    assert len(slower) == 1 and "step_time_s" in slower[0]
    other = differences({"c": rec}, {"c": digest({**plan, "runners_up": [{"label": "b"}]})})
    assert len(other) == 1 and "runners-up" in other[0]


@pytest.mark.slow
@pytest.mark.parametrize("case", CHEAP, ids=lambda c: c.id)
def test_case_plans_as_recorded(case, tmp_path_factory, monkeypatch):
    # the record was made with a cache of its own per model (tests.golden.record): no profile another test cached
    # in this worker may stand in for the case's own traces
    monkeypatch.setenv("MEMOPT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "golden-cache" / case.name))
    now = plan_record(case)
    assert not differences({case.id: RECORDED[case.id]}, {case.id: now}), differences(
        {case.id: RECORDED[case.id]}, {case.id: now})
