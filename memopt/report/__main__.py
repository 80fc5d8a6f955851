"""``python -m memopt.report RUN_DIR [--out DIR] [--rank R]``: render a recorded run's report."""

from __future__ import annotations

import argparse
import os
import sys

from memopt.config.omegaconf_errors import with_root_cause
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
        import matplotlib  # noqa: F401
    except ImportError:
        print("memopt.report: the timelines are drawn with matplotlib, which is not installed: "
              "pip install 'memopt[plot]' (or, in a checkout, pip install -e '.[plot]')", file=sys.stderr)
        return 2
    try:
        paths = render_report(args.run_dir, args.out, rank=args.rank)
        try:
            summary = summarize(load_run(args.run_dir, rank=args.rank))
        except FileNotFoundError:  # only a recorded step (a Hugging Face Trainer's run directory)
            summary = {"steps": 0, "strategies": [], "postmortem": [], "leaks": []}
    except (FileNotFoundError, ValueError) as exc:  # missing or corrupt run files: one line, exit 2
        print(f"memopt.report: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # never a traceback
        if os.environ.get("MEMOPT_DEBUG"):
            raise
        print(f"memopt.report: unexpected error {with_root_cause(exc)} -- please report it with the run "
              "directory (MEMOPT_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 2
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
