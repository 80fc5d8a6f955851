"""``python -m memopt.report RUN_DIR [--out DIR] [--rank R]``: render a recorded run's report."""

from __future__ import annotations

import argparse
import sys

from memopt.guard.report import load_run, summarize
from memopt.report import render_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memopt.report",
                                     description="Render PNG timelines, a predicted-vs-measured summary and OOM "
                                                 "post-mortems from a run directory written by memopt.")
    parser.add_argument("run_dir", help="the run directory (with telemetry.jsonl / events.jsonl)")
    parser.add_argument("--out", default=None, help="where to write the report (default: RUN_DIR/report)")
    parser.add_argument("--rank", type=int, default=0, help="which rank's telemetry to render (default 0)")
    args = parser.parse_args(argv)
    try:
        paths = render_report(args.run_dir, args.out, rank=args.rank)
    except FileNotFoundError as exc:
        print(f"memopt.report: {exc}", file=sys.stderr)
        return 2
    try:
        summary = summarize(load_run(args.run_dir, rank=args.rank))
    except FileNotFoundError:  # only a recorded step (a Hugging Face Trainer's run directory)
        summary = {"steps": 0, "strategies": [], "postmortem": [], "leaks": []}
    print(f"{summary['steps']} steps, strategies: {', '.join(summary['strategies']) or 'n/a'}")
    for pm in summary["postmortem"]:
        print(f"OOM at step {pm['step']} ({pm['phase']}): {pm['verdict']}")
    for leak in summary["leaks"]:
        print(leak["message"])
    for pm in summary["postmortem"]:
        if pm.get("module_verdict"):
            print(f"  where: {pm['module_verdict']}")
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
