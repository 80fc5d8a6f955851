#!/usr/bin/env python
"""One figure of every speed case ``scripts/speed_grid_gpu.py report`` wrote: memopt's throughput against the best
hand configuration and the Hugging Face-typical one (left), and memopt's predicted against its measured step time
(right), each report's GPU named in its label:

    python scripts/plot_speed_cases.py benchmarks/plan_quality/speed_cases/speed_cases_all.json:H200 \\
        benchmarks/plan_quality/h100_s24/speed_cases.json:H100 --out benchmarks/plan_quality/speed_cases.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", help="PATH.json:GPU")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cases = []
    for spec in args.reports:
        path, _, gpu = spec.rpartition(":")
        cases += [{**c, "gpu": gpu} for c in json.loads(Path(path).read_text())["cases"]]
    fig, (bars, clock) = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [2.2, 1]})
    width = 0.27
    for i, c in enumerate(cases):
        hand, hf = c.get("best_hand_throughput"), c.get("hf_typical_throughput")
        base = hand or c["memopt_throughput"]  # every bar relative to the best hand configuration (1.0)
        for j, (value, colour, name) in enumerate(((c["memopt_throughput"], "tab:blue", "memopt"),
                                                   (hand, "tab:gray", "best hand configuration"),
                                                   (hf, "tab:orange", "Hugging Face-typical"))):
            if value:  # hatched: no hand configuration trained, so memopt's bar is only its own scale
                bars.bar(i + (j - 1) * width, value / base, width, color=colour, label=name if i == 0 else None,
                         hatch=None if hand else "//")
        if not hand:
            bars.text(i + 0.1, 0.5, "no hand\nconfiguration\ntrains", ha="left", fontsize=7)
    bars.axhline(1.0, color="k", lw=0.6)
    bars.set_xticks(range(len(cases)), [f"{c['case']}\n({c['gpu']})" for c in cases], rotation=35, ha="right",
                    fontsize=7)
    bars.set_ylabel("throughput / best hand configuration's")
    bars.set_title("memopt's plan against a hand grid measured in the same run")
    bars.legend(fontsize=8)
    for gpu, marker in (("H200", "o"), ("H100", "s")):
        pts = [(c["measured_step_s"], c["predicted_step_s"]) for c in cases
               if c["gpu"] == gpu and c.get("measured_step_s") and c.get("predicted_step_s")]
        if pts:
            clock.scatter(*zip(*pts), marker=marker, label=f"{gpu} (prediction made then)")
    hi = max(max(c.get("measured_step_s") or 0, c.get("predicted_step_s") or 0) for c in cases) * 1.1
    clock.plot([0, hi], [0, hi], "k-", lw=0.6)
    clock.plot([0, hi], [0, 1.1 * hi], "k:", lw=0.6)
    clock.plot([0, hi], [0, 0.9 * hi], "k:", lw=0.6, label="±10%")
    clock.set_xlabel("measured step s")
    clock.set_ylabel("predicted step s")
    clock.set_title("memopt's plans: the clock")
    clock.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}: {len(cases)} cases")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
