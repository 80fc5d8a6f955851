#!/usr/bin/env python
"""Re-predict committed H200 rows on this CPU, under whatever torch and transformers are importable, and append
the result to a JSON file: shows whether a row's gap is the estimator's or the environment's.

    pip download --no-deps -d /tmp/w transformers==5.17.0 && pip install --no-deps --target /tmp/tf /tmp/w/*.whl
    PYTHONPATH=/tmp/tf:$PWD python scripts/replay_validation.py --ids t5_base/ \
        --out benchmarks/validation/t5_replay_by_transformers_version.json

(transformers 5.17 also needs the httpx and huggingface_hub 1.x it names; ``pip download transformers==5.17.0``
without ``--no-deps`` fetches them.)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import transformers

from harness.predict import estimate_row
from harness.rows import Row

REPORT = Path(__file__).resolve().parent.parent / "benchmarks" / "validation" / "estimator_h200.json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ids", nargs="+", required=True, help="row-id prefixes to replay")
    parser.add_argument("--out", required=True, help="JSON file; each run appends one entry")
    args = parser.parse_args()
    rows = [e for e in json.loads(REPORT.read_text())["rows"]
            if e.get("ok") and any(e["id"].startswith(p) for p in args.ids)]
    if not rows:
        print(f"no measured row of {REPORT.name} starts with {' or '.join(args.ids)}", file=sys.stderr)
        return 2
    replayed = []
    for e in rows:
        pred = estimate_row(Row.from_dict(e["row"]))["predicted_peak_allocated_bytes"]
        measured = e["measured_peak_allocated_bytes"]
        replayed.append({"id": e["id"], "predicted_peak_allocated_bytes": pred,
                         "measured_peak_allocated_bytes": measured, "allocated_error": (pred - measured) / measured})
        print(f"{e['id']:40s} predicted {pred} measured {measured} {100 * replayed[-1]['allocated_error']:+.3f}%",
              flush=True)
    out = Path(args.out)
    runs = json.loads(out.read_text()) if out.exists() else []
    runs.append({"torch": torch.__version__, "transformers": transformers.__version__, "rows": replayed})
    out.write_text(json.dumps(runs, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
