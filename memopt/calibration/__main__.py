"""``python -m memopt.calibration list`` shows the stored calibrations; ``... clear [--model KEY] [--hardware NAME]``
deletes them (all by default). Exit status 0, or 2 on bad arguments."""

from __future__ import annotations

import argparse
import json
import sys

from memopt.estimate.calibration import calibration_path, clear_calibration


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memopt.calibration",
                                     description="the measured/predicted ratios memopt.wrap stored for the planner")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list the stored calibrations")
    clear = sub.add_parser("clear", help="delete stored calibrations (all, or one model and/or GPU kind)")
    clear.add_argument("--model", help="a profile key (as `list` shows it)")
    clear.add_argument("--hardware", help="a GPU kind such as h100_80gb")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return 0 if exc.code == 0 else 2
    folder = calibration_path("x", "x").parent
    if args.command == "list":
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            try:
                data = json.loads(path.read_text())
                print(f"{path}: {data.get('hardware')} {data.get('profile_key')}: {len(data.get('entries', {}))} "
                      f"strateg(ies), worst measured/predicted {data.get('ratio_total')}")
            except (OSError, ValueError):
                print(f"{path}: unreadable (ignored by the planner)")
        return 0
    n = clear_calibration(args.model, args.hardware)
    print(f"removed {n} calibration file(s) from {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
