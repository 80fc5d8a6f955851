"""The plots of a run's report (``memopt.guard.report``): memory per step against the plan and the budget, the
measured peak by category, and what the largest modules kept. matplotlib is imported only when a plot is drawn."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from memopt.units import GiB, MiB

if TYPE_CHECKING:
    from memopt.guard.report import RunData

__all__ = ["categories_plot", "modules_plot", "timeline_plot"]


def _unit(max_bytes: float) -> tuple[float, str]:
    return (GiB, "GiB") if max_bytes >= GiB else (MiB, "MiB")


def _series(steps: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in steps:
        if r.get(key) is not None:
            xs.append(r["step"])
            ys.append(r[key])
    return xs, ys


def _mark_events(ax: Any, events: list[dict]) -> None:
    colors = {"oom": "tab:red", "replan": "tab:purple", "leak": "tab:orange", "stopped": "black"}
    for e in events:
        c = colors.get(e["kind"])
        if c is None:
            continue
        ax.axvline(e["step"], color=c, linestyle=":", linewidth=1.2)
        ax.annotate(e["kind"], (e["step"], 1.0), xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                    color=c, va="top", ha="left" if e["kind"] == "replan" else "right")


def timeline_plot(run: RunData, path: Path) -> Path:
    from matplotlib.figure import Figure

    steps = run.steps
    keys = ["peak_allocated_bytes", "peak_reserved_bytes", "allocated_bytes", "measured_total_bytes",
            "predicted_peak_allocated_bytes", "predicted_peak_reserved_bytes", "predicted_total_bytes",
            "budget_bytes"]
    top = max([r.get(k) or 0 for r in steps for k in keys] + [1])
    unit, name = _unit(top)
    fig = Figure(figsize=(10, 5), dpi=100)
    ax = fig.subplots()
    styles = {"peak_allocated_bytes": ("peak allocated", "tab:blue", "-"),
              "peak_reserved_bytes": ("peak reserved", "tab:green", "-"),
              "allocated_bytes": ("allocated at step end", "tab:gray", "-"),
              "measured_total_bytes": ("measured total (reserved + outside allocator)", "tab:brown", "-"),
              "predicted_peak_allocated_bytes": ("predicted peak allocated", "tab:blue", "--"),
              "predicted_peak_reserved_bytes": ("predicted peak reserved", "tab:green", "--"),
              "predicted_total_bytes": ("predicted total", "tab:brown", "--"),
              "budget_bytes": ("budget", "tab:red", "-.")}
    on_device = any(r.get("device_used_bytes") is not None for r in steps)
    for key, (label, color, ls) in styles.items():
        if key in ("measured_total_bytes", "predicted_total_bytes", "budget_bytes") and not on_device:
            continue
        xs, ys = _series(steps, key)
        if xs:
            ax.step(xs, [y / unit for y in ys], where="post" if ls != "-" else "mid", label=label, color=color,
                    linestyle=ls, linewidth=1.4)
    _mark_events(ax, run.events)
    ax.set_xlabel("step")
    ax.set_ylabel(name)
    ax.set_title("memory per step vs plan")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    return path


def categories_plot(run: RunData, path: Path) -> Path | None:
    from matplotlib.figure import Figure

    steps = [r for r in run.steps if r.get("categories_bytes") and r.get("peak_allocated_bytes") is not None]
    if not steps:
        return None
    names = ["parameters", "optimizer_states", "gradients", "activations+temporaries", "allocator_overhead",
             "outside_allocator"]
    series: dict[str, list[float]] = {n: [] for n in names}
    for r in steps:
        c = r["categories_bytes"]
        p, s, g = c.get("parameters", 0), c.get("optimizer_states", 0), c.get("gradients", 0)
        series["parameters"].append(p)
        series["optimizer_states"].append(s)
        series["gradients"].append(g)
        series["activations+temporaries"].append(max(r["peak_allocated_bytes"] - p - s - g, 0))
        series["allocator_overhead"].append(max(r["peak_reserved_bytes"] - r["peak_allocated_bytes"], 0))
        series["outside_allocator"].append(r.get("outside_allocator_bytes") or 0)
    top = max(sum(v[i] for v in series.values()) for i in range(len(steps)))
    top = max(top, *[(r.get("predicted_total_bytes") or 0) for r in steps])
    unit, uname = _unit(top)
    fig = Figure(figsize=(10, 5), dpi=100)
    ax = fig.subplots()
    xs = [r["step"] for r in steps]
    ax.stackplot(xs, *[[v / unit for v in series[n]] for n in names], labels=names, alpha=0.8)
    on_device = any(r.get("device_used_bytes") is not None for r in steps)
    key = "predicted_total_bytes" if on_device else "predicted_peak_reserved_bytes"
    px, py = _series(steps, key)
    if px:
        ax.step(px, [y / unit for y in py], where="post", color="black", linestyle="--",
                label="predicted " + ("total" if on_device else "peak reserved"))
    _mark_events(ax, run.events)
    ax.set_xlabel("step")
    ax.set_ylabel(uname)
    ax.set_title("measured peak by category (gradients at the optimizer step)")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return path


def modules_plot(run: RunData, path: Path, top: int = 8) -> Path | None:
    from matplotlib.figure import Figure

    steps = [r for r in run.steps if r.get("modules_bytes")]
    if not steps:
        return None
    peak: dict[str, int] = {}
    for r in steps:
        for m, v in r["modules_bytes"].items():
            peak[m] = max(peak.get(m, 0), v)
    names = sorted(peak, key=lambda m: -peak[m])[:top]
    unit, uname = _unit(max(peak.values(), default=1))
    fig = Figure(figsize=(10, 5), dpi=100)
    ax = fig.subplots()
    for m in names:
        ax.plot([r["step"] for r in steps], [r["modules_bytes"].get(m, 0) / unit for r in steps], label=m)
    ax.set_xlabel("step")
    ax.set_ylabel(uname)
    ax.set_title(f"bytes kept by the forward of the top {len(names)} modules")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return path
