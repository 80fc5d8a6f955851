#!/usr/bin/env python
"""Where ``memopt.wrap``'s time to the first training step goes on a GPU: one zoo row (``scripts/zoo_matrix_gpu.py``
builds it), ``memopt.wrap`` and the first ``step`` each under cProfile, with the wall time of each phase:

    python scripts/startup_profile_gpu.py pythia410m-16x2048-16GiB --out $OUT/startup_pythia.txt

Writes the phase times as JSON on the first line, then the 45 slowest functions (cumulative) of each phase.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("row")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ.setdefault("MEMOPT_CACHE_DIR", tempfile.mkdtemp(prefix="memopt_startup_"))  # a first run
    import torch
    import zoo_matrix_gpu as zoo

    import memopt

    row = next(r for r in zoo.ROWS if r.id == args.row)
    t0 = time.perf_counter()
    model, batch, calls = zoo.user_loop(row)
    build_s = time.perf_counter() - t0
    lr = {} if "optimizer" in calls else {"lr": 1e-4}
    texts = {}
    phases = {"build_s": build_s}
    for phase in ("wrap", "first_step", "second_step"):
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        if phase == "wrap":
            wrapped = memopt.wrap(model, budget=row.budget, sample=batch, fidelity=row.fidelity, **lr, **calls)
        else:
            wrapped.step(batch)
            torch.cuda.synchronize()
        prof.disable()
        phases[f"{phase}_s"] = time.perf_counter() - t
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(45)
        texts[phase] = buf.getvalue()
    phases["startup_s"] = wrapped.startup_s
    phases["plan"] = wrapped.plan.strategy.label()
    phases["autotune_trials"] = getattr(wrapped, "autotune_trials", None)
    with open(args.out, "w") as f:
        f.write(json.dumps(phases) + "\n")
        for phase, text in texts.items():
            f.write(f"\n===== {phase} =====\n{text}")
    print(json.dumps(phases))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
