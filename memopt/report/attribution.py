"""Tables and pictures of where the bytes go: the dry run's prediction, and after a run the measured step beside it.

* :func:`plan_renderables` -- the dry run's table (module group x category at the predicted peak) and the ten
  largest live tensors, as ``rich`` renderables for ``memopt.cli_render``;
* :func:`compare` -- predicted vs measured per group and category, with the difference per row;
* :func:`timeline_png` -- predicted and measured memory over one step, forward / backward / optimizer marked;
* :func:`render_attribution` -- ``attribution.md``, ``attribution.html`` (self-contained, the picture inlined)
  and ``attribution_timeline.png`` into a report folder, from a run directory.
"""

from __future__ import annotations

import base64
import html
import itertools
import json
from pathlib import Path
from typing import Any

from memopt.units import GiB, MiB, format_bytes

__all__ = ["CATEGORY_ORDER", "compare", "has_attribution", "plan_renderables", "render_attribution", "timeline_png"]

CATEGORY_ORDER = ("parameters", "gradients", "optimizer_states", "activations", "temporaries", "allocator_overhead",
                  "runtime")
_SHORT = {"parameters": "params", "gradients": "grads", "optimizer_states": "optim", "activations": "activ",
          "temporaries": "temp", "allocator_overhead": "alloc slack", "runtime": "runtime"}


def _cats(*tables: dict[str, Any]) -> list[str]:
    seen = {c for t in tables for g in (t.get("by_group") or {}).values() for c in g if c != "group"}
    return [c for c in CATEGORY_ORDER if c in seen] + sorted(seen - set(CATEGORY_ORDER))


def plan_renderables(plan: Any) -> list[Any]:
    """The dry run's attribution as rich tables (empty when the plan has none)."""
    from rich.table import Table
    from rich.text import Text

    attr = (plan.prediction or {}).get("attribution")
    if not attr:
        return []
    total = attr["total_bytes"] or 1
    cats = _cats(attr)
    table = Table(title="Where the bytes go at the predicted peak, by module group", title_justify="left")
    table.add_column("group")
    for c in cats:
        table.add_column(_SHORT.get(c, c), justify="right")
    table.add_column("total", justify="right", style="bold")
    table.add_column("share", justify="right")
    for g in attr["groups"]:
        row = attr["by_group"][g]
        s = sum(row.values())
        table.add_row(g, *[format_bytes(row[c]) if row.get(c) else "" for c in cats], format_bytes(s),
                      f"{100 * s / total:.1f}%")
    table.add_section()
    table.add_row("total", *[format_bytes(attr["by_category"].get(c, 0)) for c in cats],
                  format_bytes(attr["total_bytes"]), "100.0%", style="bold")
    top = Table(title="Largest live tensors at the peak", title_justify="left")
    for name, justify in (("size", "right"), ("category", "left"), ("module", "left"), ("op", "left"),
                          ("made in", "left")):
        top.add_column(name, justify=justify)
    for t in attr["top_tensors"]:
        size = format_bytes(t["bytes"]) + (f" x {t['count']}" if t.get("count", 1) > 1 else "")
        top.add_row(size, t["category"], t["module"], t["op"], t.get("phase", ""))
    modules = [(m, v) for m, v in attr["by_module"].items() if not m.startswith("(")][:8]
    mod = Table(title="Largest modules at the peak (repeated blocks summed over the stack)", title_justify="left")
    mod.add_column("module")
    mod.add_column("group")
    mod.add_column("bytes", justify="right")
    mod.add_column("of which", justify="left")
    for m, v in modules:
        parts = {c: b for c, b in v.items() if c != "group"}
        mod.add_row(m, v["group"], format_bytes(sum(parts.values())),
                    ", ".join(f"{_SHORT.get(c, c)} {format_bytes(b)}" for c, b in
                              sorted(parts.items(), key=lambda x: -x[1])))
    return [Text(""), table, Text("rows sum to the predicted total; repeated blocks are summed over every block "
                                  "of the stack", style="dim"), Text(""), top, Text(""), mod]


# -- predicted vs measured ------------------------------------------------------------------------------
def compare(predicted: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """Rows (group, category, predicted, measured, difference) over the union of both tables, plus per-category
    and per-group totals."""
    rows = []
    groups = list(predicted.get("groups") or []) + [g for g in measured.get("groups") or []
                                                     if g not in (predicted.get("groups") or [])]
    cats = _cats(predicted, measured)
    for g in groups:
        p, m = (predicted.get("by_group") or {}).get(g, {}), (measured.get("by_group") or {}).get(g, {})
        for c in cats:
            if p.get(c) or m.get(c):
                rows.append({"group": g, "category": c, "predicted_bytes": int(p.get(c, 0)),
                             "measured_bytes": int(m.get(c, 0)), "difference_bytes": int(m.get(c, 0) - p.get(c, 0))})
    by_cat = {c: {"predicted_bytes": int((predicted.get("by_category") or {}).get(c, 0)),
                  "measured_bytes": int((measured.get("by_category") or {}).get(c, 0))} for c in cats}
    by_group = {}
    for g in groups:
        p = sum((predicted.get("by_group") or {}).get(g, {}).values())
        m = sum((measured.get("by_group") or {}).get(g, {}).values())
        by_group[g] = {"predicted_bytes": int(p), "measured_bytes": int(m), "difference_bytes": int(m - p)}
    return {"rows": rows, "by_category": by_cat, "by_group": by_group, "categories": cats, "groups": groups}


def _unit(top: float) -> tuple[float, str]:
    return (GiB, "GiB") if top >= GiB else (MiB, "MiB")


_PHASE_COLORS = {"forward": "#dbe9f6", "backward": "#fde0c5", "optimizer": "#d9f0d3"}


def timeline_png(path: Path, predicted: dict[str, Any] | None, measured: dict[str, Any] | None,
                 title: str = "memory over one step") -> Path | None:
    """Predicted (top) and measured (bottom) allocated bytes over one step, phases shaded."""
    series = [(n, t) for n, t in (("predicted", predicted), ("measured", measured)) if t and t.get("x")]
    if not series:
        return None
    from matplotlib.figure import Figure

    top = max(max(t["bytes"]) for _, t in series)
    unit, uname = _unit(top)
    fig = Figure(figsize=(10, 2.6 * len(series) + 0.6), dpi=100)
    axes = fig.subplots(len(series), 1, sharex=True, sharey=True, squeeze=False)[:, 0]
    for ax, (name, t) in zip(axes, series):
        starts = t["phases"] + [["end", 1.0]]
        for (ph, x0), (_, x1) in itertools.pairwise(starts):
            ax.axvspan(x0, x1, color=_PHASE_COLORS.get(ph.split("[")[0], "#eeeeee"), alpha=0.8, linewidth=0)
        for ph in {p.split("[")[0] for p, _ in t["phases"]}:
            ax.plot([], [], color=_PHASE_COLORS.get(ph, "#eeeeee"), linewidth=8, label=ph)
        ax.plot(t["x"], [y / unit for y in t["bytes"]], color="tab:blue" if name == "predicted" else "tab:red",
                linewidth=1.2, label=f"{name} allocated")
        alloc = t.get("allocator")
        if alloc and alloc.get("x"):
            ax.plot(alloc["x"], [y / unit for y in alloc["bytes"]], color="black", linestyle="--", linewidth=0.9,
                    label="the allocator's own count")
        ax.set_ylabel(uname)
        ax.set_title(f"{name}", fontsize=9, loc="left")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    axes[-1].set_xlabel("fraction of the step (allocation events)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _md_table(cmp: dict[str, Any]) -> list[str]:
    lines = ["| group | category | predicted | measured | difference |", "|---|---|---|---|---|"]
    for r in cmp["rows"]:
        lines.append(f"| {r['group']} | {r['category']} | {format_bytes(r['predicted_bytes'])} | "
                     f"{format_bytes(r['measured_bytes'])} | {_signed(r['difference_bytes'])} |")
    lines += ["", "| category | predicted | measured | difference |", "|---|---|---|---|"]
    for c, v in cmp["by_category"].items():
        lines.append(f"| {c} | {format_bytes(v['predicted_bytes'])} | {format_bytes(v['measured_bytes'])} | "
                     f"{_signed(v['measured_bytes'] - v['predicted_bytes'])} |")
    return lines


def _signed(n: int) -> str:
    return ("+" if n > 0 else "-" if n < 0 else "") + format_bytes(abs(n))


def _top_md(tensors: list[dict[str, Any]]) -> list[str]:
    lines = ["| size | category | module | op | made in |", "|---|---|---|---|---|"]
    for t in tensors:
        count = f" x {t['count']}" if t.get("count", 1) > 1 else ""
        lines.append(f"| {format_bytes(t['bytes'])}{count} | {t['category']} | `{t['module']}` | {t['op']} | "
                     f"{t.get('phase', '')} |")
    return lines


def _predicted_for(plan: dict[str, Any] | None, step: int) -> dict[str, Any] | None:
    """The plan's predicted table for the measured step: the first step's own peak for step 0, the steady
    step's for later ones."""
    attr = ((plan or {}).get("prediction") or {}).get("attribution")
    if not attr:
        return None
    steps = attr.get("steps") or []
    if not steps:
        return attr
    table = dict(steps[0] if step == 0 else steps[-1])
    table["timeline"] = attr.get("timeline_first_step" if step == 0 else "timeline") or attr.get("timeline")
    return table


def has_attribution(run_dir: str | Path, *, rank: int = 0) -> bool:
    suffix = "" if rank == 0 else f".rank{rank}"
    return (Path(run_dir) / f"attribution_measured{suffix}.json").exists()


def render_attribution(run_dir: str | Path, out_dir: str | Path, *, rank: int = 0) -> dict[str, Path]:
    """Write the attribution report of a run (nothing when the run recorded no measured step)."""
    run = Path(run_dir)
    out = Path(out_dir)
    suffix = "" if rank == 0 else f".rank{rank}"
    mpath = run / f"attribution_measured{suffix}.json"
    if not mpath.exists():
        return {}
    measured = json.loads(mpath.read_text())
    plan_path = run / "plan.json"
    plan = json.loads(plan_path.read_text()) if plan_path.exists() else None
    if measured.get("plan_file"):
        alt = run / measured["plan_file"]
        if alt.exists():
            plan = json.loads(alt.read_text())
    predicted = _predicted_for(plan, int(measured.get("step", 0)))
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    mtimeline = dict(measured.get("timeline") or {})
    if (measured.get("allocator_history") or {}).get("timeline"):
        mtimeline["allocator"] = measured["allocator_history"]["timeline"]
    png = timeline_png(out / "attribution_timeline.png", (predicted or {}).get("timeline"), mtimeline or None,
                       title=f"step {measured.get('step')} ({measured.get('strategy', '')})")
    if png is not None:
        paths["attribution_timeline"] = png
    cmp = compare(predicted or {}, measured)
    (out / "attribution.json").write_text(json.dumps({"predicted": predicted, "measured": measured,
                                                      "comparison": cmp}, indent=1, default=str))
    paths["attribution_json"] = out / "attribution.json"
    md = _markdown(measured, predicted, cmp, png)
    (out / "attribution.md").write_text(md)
    paths["attribution_md"] = out / "attribution.md"
    (out / "attribution.html").write_text(_html(md, png))
    paths["attribution_html"] = out / "attribution.html"
    return paths


def _markdown(measured: dict[str, Any], predicted: dict[str, Any] | None, cmp: dict[str, Any],
              png: Path | None) -> str:
    lines = [f"# Where the bytes go: step {measured.get('step')}", "",
             f"Strategy `{measured.get('strategy', '')}`, measured on {measured.get('device', '?')} "
             f"({measured.get('method', '')})."]
    if measured.get("allocator_peak_allocated_bytes") is not None:
        lines.append(f"The allocator's own peak: {format_bytes(measured['allocator_peak_allocated_bytes'])} allocated; "
                     f"attributed here: {format_bytes(measured.get('peak_allocated_bytes', 0))}.")
    history = measured.get("allocator_history")
    if history:
        lines.append(f"The allocator's history over the step peaks at {format_bytes(history['peak_allocated_bytes'])}"
                     + (f"; its snapshot `{history['snapshot']}` opens in https://pytorch.org/memory_viz."
                        if history.get("snapshot") else "."))
    if predicted is None:
        lines += ["", "The plan carries no predicted attribution (made by an older memopt, or re-planned "
                      "without one): measured figures only."]
    lines += ["", "## At the peak, predicted vs measured", "", *_md_table(cmp), "",
              "## Largest live tensors at the measured peak", "", *_top_md(measured.get("top_tensors") or [])]
    if predicted is not None:
        lines += ["", "## Largest live tensors at the predicted peak", "", *_top_md(predicted.get("top_tensors") or [])]
    if png is not None:
        lines += ["", f"![timeline]({png.name})"]
    return "\n".join(lines) + "\n"


def _html(md: str, png: Path | None) -> str:
    """A self-contained page: the markdown's tables as HTML tables, the picture inlined."""
    body: list[str] = []
    rows: list[str] = []

    def flush() -> None:
        if rows:
            body.append("<table>" + "".join(rows) + "</table>")
            rows.clear()

    for line in md.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if all(set(c) <= {"-"} for c in cells):
                continue
            tag = "th" if not rows else "td"
            rows.append("<tr>" + "".join(f"<{tag}>{html.escape(c.strip('`'))}</{tag}>" for c in cells) + "</tr>")
            continue
        flush()
        if line.startswith("# "):
            body.append(f"<h1>{html.escape(line[2:])}</h1>")
        elif line.startswith("## "):
            body.append(f"<h2>{html.escape(line[3:])}</h2>")
        elif line.startswith("!["):
            if png is not None and png.exists():
                data = base64.b64encode(png.read_bytes()).decode()
                body.append(f'<img alt="timeline" src="data:image/png;base64,{data}">')
        elif line.strip():
            body.append(f"<p>{html.escape(line)}</p>")
    flush()
    style = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto}table{border-collapse:collapse;"
             "margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}td:first-child,"
             "th:first-child{text-align:left}img{max-width:100%}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>memopt attribution</title>"
            f"<style>{style}</style></head><body>{''.join(body)}</body></html>\n")
