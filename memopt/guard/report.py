"""Reports of a recorded run (``RUN_DIR`` written by ``Telemetry``/``RuntimeGuard``).

``render_report(run_dir)`` writes into ``RUN_DIR/report/``:

* ``timeline.png``: allocated / reserved per step (peaks and end of step, measured total on a GPU) against
  the plan's predictions and the budget; OOMs, re-plans and leaks marked;
* ``categories.png`` (when the telemetry has categories): the measured peak split into parameters,
  optimizer states, gradients, the rest of the step (activations and temporaries), allocator overhead and
  memory outside the allocator, against the predicted total;
* ``modules.png`` (when modules were recorded): what the largest modules' forward passes kept;
* ``summary.md`` and ``summary.json``: predicted vs measured per strategy, events, and after an OOM a
  post-mortem: which category overran the plan and by how much.

Post-mortem: at the failure the guard measured the allocator (allocated, reserved, the request that failed)
and the live parameters and optimizer states. Each is set against the failing plan's breakdown at its
predicted peak: parameters and optimizer states directly; the step's own memory (gradients, activations and
temporaries, which the telemetry cannot tell apart) as allocated + requested - parameters - states; the
allocator's overhead as reserved - allocated; the runtime as device used - reserved. The category with the
largest excess over its prediction is named.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memopt.guard.attribution_postmortem import oom_verdict  # the module, when the failing step was recorded
from memopt.guard.report_plots import categories_plot, modules_plot, timeline_plot
from memopt.units import format_bytes

__all__ = ["RunData", "load_run", "postmortem", "render_report", "summarize"]

STEP_CATEGORY = "gradients+activations+temporaries"


@dataclass
class RunData:
    run_dir: Path
    steps: list[dict[str, Any]]
    events: list[dict[str, Any]]
    plan: dict[str, Any] | None
    plans: list[dict[str, Any]] = field(default_factory=list)
    oom_report: dict[str, Any] | None = None


def _jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file; a line cut short by a crash is skipped, but a file none of whose lines
    is a JSON record is corrupt, and says so (it is not "missing")."""
    if not path.exists():
        return []
    out = []
    bad: list[int] = []
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} cannot be read ({type(exc).__name__}: {exc}); it is not a memopt telemetry "
                         "file any more") from None
    for i, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if line:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                bad.append(i)
                continue  # a line cut short by a crash
            if isinstance(rec, dict):
                out.append(rec)
            else:
                bad.append(i)
    if bad and not out:
        raise ValueError(f"{path} is corrupt: none of its {len(bad)} line(s) is a JSON record (first bad line "
                         f"{bad[0]}); it was damaged or is not a memopt telemetry file")
    return out


def _json_file(path: Path) -> Any:
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is corrupt ({exc}); remove it or re-run to write it again") from None


def load_run(run_dir: str | os.PathLike[str], *, rank: int = 0) -> RunData:
    d = Path(run_dir)
    suffix = "" if rank == 0 else f".rank{rank}"
    steps = _jsonl(d / f"telemetry{suffix}.jsonl")
    events = _jsonl(d / f"events{suffix}.jsonl")
    if not steps and not events:
        raise FileNotFoundError(f"{d} has no telemetry{suffix}.jsonl or events{suffix}.jsonl: not a memopt run "
                                "directory (RuntimeGuard/Telemetry with run_dir= writes them)")
    plan = _json_file(d / "plan.json")
    plans = []
    if (d / "plans").is_dir():
        files = sorted((d / "plans").glob("plan_*.json"), key=lambda p: int(p.stem.split("_")[1]))
        plans = [_json_file(p) for p in files]
    oom = _json_file(d / "oom_report.json")
    return RunData(run_dir=d, steps=steps, events=events, plan=plan, plans=plans, oom_report=oom)


# -- analysis ------------------------------------------------------------------------------------------
def _rel(measured: float | None, predicted: float | None) -> float | None:
    if measured is None or not predicted:
        return None
    return measured / predicted - 1.0


def summarize(run: RunData) -> dict[str, Any]:
    """Predicted vs measured per strategy, the events, and post-mortems."""
    by: dict[str, dict[str, Any]] = {}
    for rec in run.steps:
        label = rec.get("strategy") or "(no plan)"
        s = by.setdefault(label, {"steps": 0, "first_step": rec["step"], "times": [],
                                  "predicted_peak_allocated_bytes": rec.get("predicted_peak_allocated_bytes"),
                                  "predicted_peak_reserved_bytes": rec.get("predicted_peak_reserved_bytes"),
                                  "predicted_total_bytes": rec.get("predicted_total_bytes"),
                                  "predicted_step_time_s": rec.get("predicted_step_time_s"),
                                  "measured_peak_allocated_bytes": None, "measured_peak_reserved_bytes": None,
                                  "measured_total_bytes": None})
        s["steps"] += 1
        s["last_step"] = rec["step"]
        if rec.get("step_time_s") is not None and rec.get("attempts", 1) == 1:
            s["times"].append(rec["step_time_s"])
        on_device = rec.get("device_used_bytes") is not None
        for k, src in (("measured_peak_allocated_bytes", "peak_allocated_bytes"),
                       ("measured_peak_reserved_bytes", "peak_reserved_bytes"),
                       ("measured_total_bytes", "measured_total_bytes" if on_device else None)):
            v = rec.get(src) if src else None
            if v is not None:
                s[k] = v if s[k] is None else max(s[k], v)
    for s in by.values():
        times = s.pop("times")
        s["measured_step_time_s"] = statistics.median(times) if times else None
        s["error_peak_allocated"] = _rel(s["measured_peak_allocated_bytes"], s["predicted_peak_allocated_bytes"])
        s["error_peak_reserved"] = _rel(s["measured_peak_reserved_bytes"], s["predicted_peak_reserved_bytes"])
        s["error_total"] = _rel(s["measured_total_bytes"], s["predicted_total_bytes"])
        s["error_step_time"] = _rel(s["measured_step_time_s"], s["predicted_step_time_s"])
    kinds: dict[str, int] = {}
    for e in run.events:
        kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
    return {
        "run_dir": str(run.run_dir), "steps": len(run.steps), "strategies": list(by),
        "plan": {k: (run.plan or {}).get(k) for k in ("peak_allocated_bytes", "peak_reserved_bytes", "total_bytes",
                                                       "budget_bytes", "step_time_s", "strategy_label", "hardware")},
        "by_strategy": by, "events": kinds,
        "leaks": [e for e in run.events if e["kind"] == "leak"],
        "postmortem": postmortem(run),
        "stopped": run.oom_report.get("final") if run.oom_report else None,
    }


def postmortem(run: RunData) -> list[dict[str, Any]]:
    """For each OOM on this rank: measured at the failure vs the failing plan's breakdown, and the culprit."""
    out = []
    for e in run.events:
        if e["kind"] != "oom" or e.get("phase") == "peer":
            continue
        pred = e.get("predicted") or {}
        bd = {k: int(v) for k, v in (pred.get("breakdown") or {}).items()}
        cats = e.get("categories_bytes") or {}
        rows: list[dict[str, Any]] = []
        row = _row_adder(rows)
        params, states = cats.get("parameters"), cats.get("optimizer_states")
        row("parameters", params, bd.get("parameters"))
        row("optimizer_states", states, bd.get("optimizer_states"))
        allocated, reserved = e.get("allocated_bytes"), e.get("reserved_bytes")
        if allocated is not None and params is not None and states is not None:
            need = allocated + (e.get("requested_bytes") or 0)
            row(STEP_CATEGORY, need - params - states,
                sum(bd.get(k, 0) for k in ("gradients", "activations", "temporaries")))
        if allocated is not None and reserved is not None:
            row("allocator_overhead", reserved - allocated, bd.get("allocator_overhead"))
        if reserved is not None and e.get("device_used_bytes") is not None:
            row("runtime", e["device_used_bytes"] - reserved, bd.get("runtime", pred.get("runtime_bytes")))
        worst = max(rows, key=lambda r: r["over_bytes"], default=None)
        needed, total = e.get("needed_bytes"), pred.get("total_bytes")
        if worst is not None and worst["over_bytes"] > 0:
            verdict = (f"{worst['category']} overran the plan by {format_bytes(worst['over_bytes'])} (measured "
                       f"{format_bytes(worst['measured_bytes'])}, planned {format_bytes(worst['predicted_bytes'])})")
        else:
            verdict = "no measured category exceeded its prediction at the failure"
        if needed and total:
            verdict += (f"; the step needed at least {format_bytes(needed)} against a predicted "
                        f"{format_bytes(total)} ({needed / total - 1:+.1%})")
        if e.get("budget_bytes"):
            verdict += f", budget {format_bytes(e['budget_bytes'])}"
        where = oom_verdict(run.run_dir, e, run.events, _plan_for(run, e))
        out.append({"step": e.get("step"), "attempt": e.get("attempt"), "phase": e.get("phase"),
                    "location": e.get("location"), "strategy": e.get("strategy"), "rank": e.get("rank"),
                    "requested_bytes": e.get("requested_bytes"), "needed_bytes": needed,
                    "predicted_total_bytes": total, "predicted_peak_at": pred.get("peak_at"), "rows": rows,
                    "culprit": worst["category"] if worst is not None and worst["over_bytes"] > 0 else None,
                    "verdict": verdict, "snapshot": e.get("snapshot_path"),
                    "module_verdict": where["text"] if where else None, "attribution": where})
    return out


def _plan_for(run: RunData, event: dict[str, Any]) -> dict[str, Any] | None:
    """The plan the failing step ran under: the last re-plan before the event, else the first plan."""
    replans = [e for e in run.events if e.get("kind") == "replan" and e.get("step", 0) <= event.get("step", 0)
               and run.events.index(e) < run.events.index(event)]
    if replans and run.plans and len(replans) <= len(run.plans):
        return run.plans[len(replans) - 1]
    return run.plan


def _row_adder(rows: list[dict[str, Any]]) -> Any:
    def row(name: str, measured: int | None, predicted: int | None) -> None:
        if measured is None or predicted is None:
            return
        rows.append({"category": name, "measured_bytes": int(measured), "predicted_bytes": int(predicted),
                     "over_bytes": int(measured - predicted)})
    return row


# -- rendering -----------------------------------------------------------------------------------------
def _fmt(v: Any) -> str:
    return "n/a" if v is None else format_bytes(v)


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:+.1%}"


def _markdown(summary: dict[str, Any], images: dict[str, Path]) -> str:
    lines = [f"# memopt run report: {summary['run_dir']}", "", f"{summary['steps']} steps recorded."]
    plan = summary["plan"]
    if plan.get("strategy_label"):
        lines.append(f"Plan: `{plan['strategy_label']}` on {plan.get('hardware')}, budget "
                     f"{_fmt(plan.get('budget_bytes'))}.")
    if summary["stopped"]:
        lines += ["", f"**Stopped:** {summary['stopped']}"]
    lines += ["", "## Predicted vs measured", "",
              "| strategy | steps | peak allocated (pred / meas) | peak reserved (pred / meas) | "
              "total (pred / meas) | step time (pred / meas) |", "|---|---|---|---|---|---|"]
    for label, s in summary["by_strategy"].items():
        t_pred, t_meas = s["predicted_step_time_s"], s["measured_step_time_s"]
        lines.append(
            f"| `{label}` | {s['steps']} | {_fmt(s['predicted_peak_allocated_bytes'])} / "
            f"{_fmt(s['measured_peak_allocated_bytes'])} ({_pct(s['error_peak_allocated'])}) | "
            f"{_fmt(s['predicted_peak_reserved_bytes'])} / {_fmt(s['measured_peak_reserved_bytes'])} "
            f"({_pct(s['error_peak_reserved'])}) | {_fmt(s['predicted_total_bytes'])} / "
            f"{_fmt(s['measured_total_bytes'])} ({_pct(s['error_total'])}) | "
            f"{'n/a' if t_pred is None else f'{t_pred:.3f} s'} / {'n/a' if t_meas is None else f'{t_meas:.3f} s'} |")
    if summary["events"]:
        lines += ["", "## Events", ""] + [f"- {k}: {v}" for k, v in sorted(summary["events"].items())]
    for leak in summary["leaks"]:
        lines += ["", "## Memory leak", "", leak["message"]]
    for pm in summary["postmortem"]:
        lines += ["", f"## Post-mortem: OOM at step {pm['step']} (attempt {pm['attempt']}, {pm['phase']})", "",
                  f"Strategy `{pm['strategy']}`; the plan predicted its peak at: {pm['predicted_peak_at']}.", "",
                  f"**{pm['verdict']}**", "", *([f"Where: {pm['module_verdict']}.", ""] if pm.get("module_verdict")
                                                  else []),
                  "| category | measured | planned | over |", "|---|---|---|---|"]
        for r in pm["rows"]:
            lines.append(f"| {r['category']} | {_fmt(r['measured_bytes'])} | {_fmt(r['predicted_bytes'])} | "
                         f"{_fmt(r['over_bytes'])} |")
        if pm.get("snapshot"):
            lines += ["", f"Memory snapshot: `{pm['snapshot']}` (open in https://pytorch.org/memory_viz)"]
    if images:
        lines += ["", "## Timelines", ""] + [f"![{k}]({p.name})" for k, p in images.items()]
    return "\n".join(lines) + "\n"


def render_report(run_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str] | None = None, *,
                  rank: int = 0) -> dict[str, Path]:
    """Write the report files (see the module docstring); returns their paths by name."""
    run = load_run(run_dir, rank=rank)
    out = Path(out_dir) if out_dir is not None else run.run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    images: dict[str, Path] = {}
    if run.steps:
        images["timeline"] = timeline_plot(run, out / "timeline.png")
        for name, fn in (("categories", categories_plot), ("modules", modules_plot)):
            p = fn(run, out / f"{name}.png")
            if p is not None:
                images[name] = p
    summary = summarize(run)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    (out / "summary.md").write_text(_markdown(summary, images))
    paths = {**images, "summary_json": out / "summary.json", "summary_md": out / "summary.md"}
    if summary["postmortem"]:
        (out / "postmortem.json").write_text(json.dumps(summary["postmortem"], indent=2, default=str))
        paths["postmortem"] = out / "postmortem.json"
    return paths
