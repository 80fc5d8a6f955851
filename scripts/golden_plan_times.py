#!/usr/bin/env python
"""How long the behaviour record's plans took, between two records: every shipped config, recipe, zoo family and
plain-PyTorch pattern (``tests/golden/plans.json``, each case's ``plan_s``), by group, and whether each plan's summary
(strategy, peaks, step time, notes) stayed the same.

    python scripts/golden_plan_times.py BEFORE_COMMIT [AFTER_COMMIT] --out benchmarks/planner_speed/golden_NAME

``AFTER_COMMIT`` left out: the working tree's record; either may be a record file's path instead of a commit. A
record is made by ``python -m tests.golden.record record --jobs 2`` (two worker processes, one model's cases in one
worker, so its first case carries the model's trace): the two records compared should come from the same machine
under the same load (two records made side by side, one job each, share it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = "tests/golden/plans.json"


def _record(commit: str | None) -> dict:
    """The record's cases: the working tree's (None), a record file's (a path), or a commit's."""
    if commit is None:
        return json.loads((ROOT / RECORD).read_text())["cases"]
    if Path(commit).is_file():  # a record made elsewhere (a worktree of another commit)
        return json.loads(Path(commit).read_text())["cases"]
    return json.loads(subprocess.check_output(["git", "-C", str(ROOT), "show", f"{commit}:{RECORD}"]))["cases"]


def compare(before: dict, after: dict) -> dict:
    groups: dict[str, dict[str, float]] = {}
    changed = []
    for case, old in before.items():
        new = after.get(case)
        if new is None:
            continue
        g = groups.setdefault(case.split(":")[0], {"cases": 0, "before_s": 0.0, "after_s": 0.0})
        g["cases"] += 1
        g["before_s"] += old["plan_s"]
        g["after_s"] += new["plan_s"]
        if old.get("summary") != new.get("summary") or old.get("error") != new.get("error"):
            changed.append(case)
    total = {"cases": sum(g["cases"] for g in groups.values()),
             "before_s": sum(g["before_s"] for g in groups.values()),
             "after_s": sum(g["after_s"] for g in groups.values())}
    ratios = [after[c]["plan_s"] / before[c]["plan_s"] for c in before if c in after and before[c]["plan_s"] > 0]
    return {"groups": groups, "total": total, "summaries_changed": changed,
            "median_case_ratio": statistics.median(ratios) if ratios else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before")
    ap.add_argument("after", nargs="?")
    ap.add_argument("--out", required=True, help="path without suffix: .json and .md are written")
    args = ap.parse_args()
    result = compare(_record(args.before), _record(args.after))
    result.update(before=args.before, after=args.after or "working tree")
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# Plan time of the behaviour record: {args.before} -> {args.after or 'working tree'}", "",
             "| group | cases | before s | after s | after / before |", "|---|---|---|---|---|"]
    for name, g in [*sorted(result["groups"].items()), ("all", result["total"])]:
        lines.append(f"| {name} | {g['cases']} | {g['before_s']:.0f} | {g['after_s']:.0f} | "
                     f"{g['after_s'] / g['before_s']:.2f} |")
    lines += ["", f"Median per-case ratio: {result['median_case_ratio']:.2f}. Summaries changed: "
              f"{len(result['summaries_changed'])} ({', '.join(result['summaries_changed']) or 'none'})."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
