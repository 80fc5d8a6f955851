"""The behaviour record: the plan of every shipped model config, every recipe, every zoo family and every plain-PyTorch
pattern at three budgets, kept in ``plans.json`` so that a refactor can prove it changed nothing.

    python -m tests.golden.record record [--jobs 2]     # writes plans.json from this tree
    python -m tests.golden.record check [--jobs 2]      # plans every case again, lists the ones that differ
    ... [--only pattern:batchnorm,zoo:image_classification]   # only the cases whose id contains one of these

A record is the SHA-256 of the plan's JSON (strategy, peaks by category, step time and its rate, runners-up,
rejections, notes, the infeasibility report), less the search's wall-clock timings, with a summary beside it that
names what changed: the floats are the same bits or the case differs. Planning is deterministic (no deadline in the
search), so a difference is a change of behaviour. An intended change (a refit clock, a new technique) regenerates the
record in the same commit.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RECORD = Path(__file__).with_name("plans.json")
CONFIG_BUDGETS = ("8GB", "24GB", "80GB")
RECIPE_BUDGETS = (None, "12GB", "40GB")  # None: the recipe's own budget
TINY_BUDGETS = ("1.2GB", "2GB", "10GB")
TINY_BATCH = 8
_TIMINGS = ("seconds", "search_s", "profile_trace_s")  # the search's wall-clock measurements


@dataclass(frozen=True)
class Case:
    id: str
    group: str  # config, recipe, zoo, pattern
    name: str
    budget: str | None


def cases() -> list[Case]:
    from tests.zoo.hf_families import FAMILIES
    from tests.zoo.torch_patterns import PATTERNS

    out: list[Case] = []
    for path in sorted((ROOT / "configs" / "model").glob("*.yaml")):
        out += [Case(f"config:{path.stem}@{b}", "config", path.stem, b) for b in CONFIG_BUDGETS]
    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        out += [Case(f"recipe:{path.stem}@{b or 'own'}", "recipe", path.stem, b) for b in RECIPE_BUDGETS]
    for fam in FAMILIES:
        out += [Case(f"zoo:{fam.id}@{b}", "zoo", fam.id, b) for b in TINY_BUDGETS]
    for pat in PATTERNS:
        out += [Case(f"pattern:{pat.name}@{b}", "pattern", pat.name, b) for b in TINY_BUDGETS]
    return out


def _without_timings(value: Any) -> Any:
    """The plan's JSON less what a clock on the wall measured (the search's seconds)."""
    if isinstance(value, dict):
        return {k: _without_timings(v) for k, v in value.items() if k not in _TIMINGS}
    if isinstance(value, list):
        return [_without_timings(v) for v in value]
    return value


def _config_plan(case: Case) -> Any:
    from memopt.config.compose import compose_plan_config
    from memopt.config.validate import resolve

    if case.group == "config":
        cfg = compose_plan_config([f"model={case.name}", f"budget={case.budget}", "hardware=h100_80gb"])
    else:
        overrides = [] if case.budget is None else [f"budget={case.budget}"]
        cfg = compose_plan_config(overrides, config_name=case.name, config_dir=ROOT / "recipes")
    return resolve(cfg).plan()


def _module_plan(case: Case) -> Any:
    import torch

    import memopt
    from tests.zoo.hf_families import FAMILIES
    from tests.zoo.torch_patterns import PATTERNS

    if case.group == "zoo":
        fam = next(f for f in FAMILIES if f.id == case.name)
        return memopt.plan(fam.build(), fam.sample(TINY_BATCH), budget=case.budget, hardware="h200")
    pat = next(p for p in PATTERNS if p.name == case.name)
    return memopt.plan(pat.build(), pat.sample(TINY_BATCH, torch.Generator().manual_seed(0)), budget=case.budget,
                       hardware="h200", loss_fn=pat.loss_fn)


_SUMMARY = ("fits", "strategy_label", "peak_allocated_bytes", "peak_reserved_bytes", "total_bytes", "step_time_s",
            "breakdown", "peak_at", "notes")


def digest(plan: dict[str, Any]) -> dict[str, Any]:
    """The record of one plan's JSON: its hash, and the fields a reader looks at first when it changes."""
    text = json.dumps(_without_timings(plan), sort_keys=True)
    return {"sha256": hashlib.sha256(text.encode()).hexdigest(), "summary": {k: plan.get(k) for k in _SUMMARY}}


#: the host RAM the record plans offload for (the recording machine's): neither another machine's RAM nor what its
#: processes hold at the moment may decide a recorded plan
RECORD_HOST_MEMORY = "25275973632"


def plan_record(case: Case) -> dict[str, Any]:
    """What ``case`` plans to today, as recorded; an error is recorded as its type and message."""
    warnings.filterwarnings("ignore")
    planner: Callable[[Case], Any] = _config_plan if case.group in ("config", "recipe") else _module_plan
    start = time.perf_counter()
    before = os.environ.get("MEMOPT_HOST_MEMORY")
    os.environ["MEMOPT_HOST_MEMORY"] = RECORD_HOST_MEMORY
    try:
        record: dict[str, Any] = digest(planner(case).to_dict())
    except Exception as exc:  # a refusal is behaviour too
        record = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        if before is None:
            del os.environ["MEMOPT_HOST_MEMORY"]
        else:
            os.environ["MEMOPT_HOST_MEMORY"] = before
    record["plan_s"] = round(time.perf_counter() - start, 1)  # not compared: how long the case takes
    return record


def _init_worker(cache: str) -> None:
    os.environ["MEMOPT_CACHE_DIR"] = cache
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


def run_all(selected: list[Case], jobs: int) -> dict[str, dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="memopt-record-") as cache:
        # cases of one model run in one worker, one after another, so its profile is traced once
        by_model: dict[str, list[Case]] = {}
        for case in selected:
            by_model.setdefault(f"{case.group}:{case.name}", []).append(case)
        with ProcessPoolExecutor(max_workers=jobs, initializer=_init_worker, initargs=(cache,)) as pool:
            futures = {key: pool.submit(_plan_group, group) for key, group in by_model.items()}
            out: dict[str, dict[str, Any]] = {}
            for key, fut in futures.items():
                records = fut.result()
                out.update(records)
                print(f"  {key}: {sum(r['plan_s'] for r in records.values()):.1f} s", flush=True)
    return out


def _plan_group(group: list[Case]) -> dict[str, dict[str, Any]]:
    return {case.id: plan_record(case) for case in group}


def differences(recorded: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The cases whose plan (or error) is not the recorded one, each with the first differing field."""
    out = []
    for case_id, rec in recorded.items():
        got = now.get(case_id)
        if got is None:
            continue
        old = {k: v for k, v in rec.items() if k != "plan_s"}
        new = {k: v for k, v in got.items() if k != "plan_s"}
        if old == new:
            continue
        if "summary" in old and "summary" in new:
            where = (_first_difference(old["summary"], new["summary"], "summary") if old["summary"] != new["summary"]
                     else "runners-up, rejections or the infeasibility report (the summary is the same)")
        else:
            where = _first_difference(old, new)  # a plan where an error was, or the other way round
        out.append(f"{case_id}: {where}")
    return out


def _first_difference(a: Any, b: Any, path: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return _first_difference(a.get(key), b.get(key), f"{path}.{key}")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                return _first_difference(x, y, f"{path}[{i}]")
    return f"{path or '<root>'}: recorded {json.dumps(a)[:160]}, now {json.dumps(b)[:160]}"


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("record", "check"):
        print(__doc__)
        return 2
    jobs = int(argv[argv.index("--jobs") + 1]) if "--jobs" in argv else 2
    only = argv[argv.index("--only") + 1].split(",") if "--only" in argv else None
    every = cases()
    selected = [c for c in every if only is None or any(part in c.id for part in only)]
    start = time.perf_counter()
    now = run_all(selected, jobs)
    if argv[0] == "record":
        import torch
        import transformers

        # an intended change re-records the cases it touches; the others keep their record
        kept = json.loads(RECORD.read_text())["cases"] if only is not None else {}
        doc = {"torch": torch.__version__, "transformers": transformers.__version__,
               "cases": {c.id: now[c.id] if c.id in now else kept[c.id] for c in every}}
        RECORD.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        print(f"recorded {len(now)} plans in {time.perf_counter() - start:.0f} s: {RECORD}")
        return 0
    recorded = json.loads(RECORD.read_text())["cases"]
    missing = sorted(set(recorded) ^ {c.id for c in every})
    diffs = differences(recorded, now)
    for line in diffs + [f"{m}: in only one of the record and the case list" for m in missing]:
        print(line)
    print(f"{len(now) - len(diffs)} of {len(now)} plans as recorded ({time.perf_counter() - start:.0f} s)")
    return 1 if diffs or missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
