"""Tables and pictures of ``scripts/attribution_gpu.py``'s rows: predicted vs measured bytes at the peak of one
step, per category and per module group, for each model.

    python scripts/report_attribution.py /tmp/attribution_rows --out benchmarks/attribution

Writes ``attribution_h200.md`` (the tables), ``attribution_h200.jsonl`` (the rows), ``categories_h200.png``
(predicted and measured per category, every model) and each model's ``<model>_timeline.png``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from memopt.report.attribution import CATEGORY_ORDER  # noqa: E402
from memopt.units import format_bytes  # noqa: E402


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.2f}%"


def markdown(rows: list[dict[str, Any]], command: str) -> str:
    ok = [r for r in rows if "error" not in r]
    lines = ["# Where the bytes go: predicted vs measured on one step", "",
             f"Command: `{command}`", "",
             "Each model trained a few steps under `memopt.wrap` (plan made for the local GPU); its second step was "
             "recorded by module and op. Errors are (measured - predicted) / predicted peak allocated, per category "
             "(the validation bound: within 3%).", "",
             "| model | family | strategy | predicted peak | measured peak | allocator's peak | worst category "
             "error | within 3% |", "|---|---|---|---|---|---|---|---|"]
    for r in ok:
        errors = {c: e for c, e in r["category_error_of_peak"].items() if e is not None}
        worst = max(errors.items(), key=lambda kv: abs(kv[1]), default=(None, None))
        alloc = r.get("allocator_peak_allocated_bytes")
        lines.append(f"| {r['model']} | {r['family']} | `{r['strategy']}` | "
                     f"{format_bytes(r['predicted_peak_allocated_bytes'])} | "
                     f"{format_bytes(r['measured_peak_allocated_bytes'])} | "
                     f"{format_bytes(alloc) if alloc is not None else 'n/a'} | {worst[0]} {_pct(worst[1])} | "
                     f"{'yes' if r['within_3pct'] else 'no'} |")
    for r in rows:
        if "error" in r:
            lines += ["", f"**{r['model']} failed:** `{r['error']}`"]
    for r in ok:
        cats = [c for c in CATEGORY_ORDER if c in r["predicted_by_category_bytes"] or c in
                r["measured_by_category_bytes"]]
        lines += ["", f"## {r['model']} ({r['family']})", "", "| category | predicted | measured | error of peak |",
                  "|---|---|---|---|"]
        for c in cats:
            lines.append(f"| {c} | {format_bytes(r['predicted_by_category_bytes'].get(c, 0))} | "
                         f"{format_bytes(r['measured_by_category_bytes'].get(c, 0))} | "
                         f"{_pct(r['category_error_of_peak'].get(c))} |")
        lines += ["", "| module group | predicted | measured | difference |", "|---|---|---|---|"]
        for g, v in r["by_module"].items():
            p, m = sum(v["predicted"].values()), sum(v["measured"].values())
            lines.append(f"| {g} | {format_bytes(p)} | {format_bytes(m)} | {'+' if m >= p else '-'}"
                         f"{format_bytes(abs(m - p))} |")
        lines += ["", f"![{r['model']} timeline]({r['model']}_timeline.png)"]
    return "\n".join(lines) + "\n"


def categories_png(rows: list[dict[str, Any]], path: Path) -> Path | None:
    ok = [r for r in rows if "error" not in r]
    if not ok:
        return None
    from matplotlib.figure import Figure

    cats = [c for c in CATEGORY_ORDER if any(c in r["predicted_by_category_bytes"] or c in
                                              r["measured_by_category_bytes"] for r in ok)]
    fig = Figure(figsize=(max(6, 2.2 * len(ok)), 4.5), dpi=100)
    ax = fig.subplots()
    width = 0.38
    bottoms = {"p": [0.0] * len(ok), "m": [0.0] * len(ok)}
    colors = dict(zip(CATEGORY_ORDER, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple",
                                       "tab:gray", "tab:brown")))
    for c in cats:
        for side, key, shift in (("p", "predicted_by_category_bytes", -width / 2),
                                 ("m", "measured_by_category_bytes", width / 2)):
            vals = [r[key].get(c, 0) / r["predicted_peak_allocated_bytes"] for r in ok]
            ax.bar([i + shift for i in range(len(ok))], vals, width, bottom=bottoms[side], color=colors[c],
                   label=c if side == "p" else None, edgecolor="white", hatch="" if side == "p" else "//")
            bottoms[side] = [b + v for b, v in zip(bottoms[side], vals)]
    ax.set_xticks(range(len(ok)), [f"{r['model']}\n(pred | meas)" for r in ok], fontsize=8)
    ax.set_ylabel("share of the predicted peak")
    ax.set_title("bytes at the peak by category: predicted (plain) vs measured (hatched)")
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    fig.tight_layout()
    fig.savefig(path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows_dir", help="the --out folder of scripts/attribution_gpu.py")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "attribution"))
    parser.add_argument("--command", default="PYTHONUNBUFFERED=1 python scripts/attribution_gpu.py --out ROWS")
    args = parser.parse_args(argv)
    src, out = Path(args.rows_dir), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(p.read_text()) for p in sorted(src.glob("*.json"))]
    if not rows:
        print(f"no rows in {src}", file=sys.stderr)
        return 2
    (out / "attribution_h200.jsonl").write_text("".join(json.dumps(r, default=str) + "\n" for r in rows))
    for r in rows:
        png = src / f"{r['model']}_timeline.png"
        if png.exists():
            shutil.copy(png, out / png.name)
    categories_png(rows, out / "categories_h200.png")
    (out / "attribution_h200.md").write_text(markdown(rows, args.command))
    print(f"wrote {out / 'attribution_h200.md'} ({len(rows)} models)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
