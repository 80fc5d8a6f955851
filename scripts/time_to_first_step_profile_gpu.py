#!/usr/bin/env python
"""Where the time to the first trained step goes on a GPU machine: one speed case's ``memopt.wrap`` and first
``step`` (trace, plan, autotune, apply) under cProfile, from an empty cache. Writes the wall times and the
profile's top functions (cumulative and own time) to OUT:

    python scripts/time_to_first_step_profile_gpu.py qwen3-0.6b-16x2048-16GiB $OUT/ttfs_profile.txt

cProfile slows Python-heavy work about 1.5-2x, so compare its seconds with each other, not with an unprofiled run.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import speed_grid_gpu as grid  # noqa: E402 - the speed cases
import zoo_matrix_gpu as zoo  # noqa: E402


def main() -> int:
    import torch

    import memopt

    case = next(c for c in grid.CASES if c.id == sys.argv[1])
    t0 = time.perf_counter()
    model = zoo.build(case.row)
    batch = zoo.batch_for(case.row, model)
    t1 = time.perf_counter()
    profiler = cProfile.Profile()
    profiler.enable()
    wrapped = memopt.wrap(model, budget=case.row.budget, sample=batch, lr=1e-4)
    t2 = time.perf_counter()
    wrapped.step(batch)
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    profiler.disable()
    out = io.StringIO()
    print(f"build {t1 - t0:.1f}s wrap {t2 - t1:.1f}s first step {t3 - t2:.1f}s plan {wrapped.plan.strategy.label()}",
          file=out)
    print("notes:", *wrapped.plan.notes[:12], sep="\n  ", file=out)
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("cumulative").print_stats(70)
    stats.sort_stats("tottime").print_stats(30)
    Path(sys.argv[2]).write_text(out.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
