"""Time the dry-run planner on one model: profile, cold plan, plan from a cached profile (in-process and CLI).

    python scripts/time_planner.py                      # llama3_70b, budget 80GB, h100_80gb
    python scripts/time_planner.py --model llama3_8b --budget 40GB --out /tmp/t.json
    python scripts/time_planner.py --src /tmp/head --out /tmp/before.json   # another checkout's memopt

In-process figures are ``time.perf_counter`` (and ``time.process_time``: ``*_cpu_s``) around the call
(Python/torch imports excluded); CLI figures are the wall time of ``python -m memopt.plan ... output=json`` in a
subprocess (imports included). Every measurement runs in a fresh process; "cold" ones get an empty cache
directory. "profile_then_plan_cold" profiles (cold) and then plans
in one process: ``plan_after_profile_s`` is the cold plan's time beyond the profile's. "warm" plans reuse the cold
plan's cache (profile and estimate memo); "cached_profile" ones have the
profile in the cache but no estimate memo (``MEMOPT_NO_ESTIMATE_CACHE=1``): the estimates are computed afresh.
Writes JSON (default ``benchmarks/planner_speed/<model>.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _child(mode: str, model: str, budget: str, hardware: str) -> dict[str, Any]:
    """Runs in a subprocess: one in-process measurement."""
    start = time.perf_counter()
    import memopt.estimate.estimator as estimator
    from memopt.plan.planner import make_plan
    from memopt.profile.api import profile_model

    imports_s = time.perf_counter() - start
    replays = [0]
    simulate = estimator.simulate_allocator

    def counting(*args: Any, **kwargs: Any) -> Any:
        replays[0] += 1
        return simulate(*args, **kwargs)

    estimator.simulate_allocator = counting
    start, cpu = time.perf_counter(), time.process_time()  # CPU time: less sensitive to other jobs on the cores
    if mode in ("profile", "profile_then_plan"):
        prof = profile_model(model, hardware=hardware)
        out = {"imports_s": imports_s, "profile_s": time.perf_counter() - start,
               "profile_cpu_s": time.process_time() - cpu, "trace_s": prof.trace_s}
        if mode == "profile_then_plan":  # the cold plan's time beyond the profile, in one process
            start, cpu = time.perf_counter(), time.process_time()
            plan = make_plan(model, budget=budget, hardware=hardware, profile=prof)
            out.update({"plan_after_profile_s": time.perf_counter() - start,
                        "plan_after_profile_cpu_s": time.process_time() - cpu, "fits": plan.fits})
        return out
    plan = make_plan(model, budget=budget, hardware=hardware)
    seconds = time.perf_counter() - start
    search = plan.to_dict().get("search", {})
    return {"imports_s": imports_s, "plan_s": seconds, "plan_cpu_s": time.process_time() - cpu, "fits": plan.fits,
            "total_bytes": plan.total_bytes,
            "candidates": search.get("candidates"), "evaluated": search.get("evaluated"),
            "pruned_as_too_big": search.get("pruned_as_too_big"), "pruned_as_slower": search.get("pruned_as_slower"),
            "allocator_replays": replays[0]}


def _env(args: argparse.Namespace, cache: str, memo: bool) -> dict[str, str]:
    env = {**os.environ, "MEMOPT_CACHE_DIR": cache, "TRANSFORMERS_VERBOSITY": "error"}
    env.pop("MEMOPT_NO_ESTIMATE_CACHE", None)
    if not memo:
        env["MEMOPT_NO_ESTIMATE_CACHE"] = "1"
    if args.src:
        env["PYTHONPATH"] = os.pathsep.join([str(args.src), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _run_child(mode: str, args: argparse.Namespace, cache: str, memo: bool = True) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", mode, "--model", args.model, "--budget", args.budget,
           "--hardware", args.hardware]
    out = subprocess.run(cmd, env=_env(args, cache, memo), capture_output=True, text=True, check=True,
                         cwd=args.src or ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cli_wall(args: argparse.Namespace, cache: str, memo: bool = True) -> float:
    cmd = [sys.executable, "-m", "memopt.plan", f"model={args.model}", f"budget={args.budget}",
           f"hardware={args.hardware}", "output=json"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=_env(args, cache, memo), capture_output=True, text=True, cwd=args.src or ROOT)
    wall = time.perf_counter() - start
    if proc.returncode not in (0, 3):  # 3: nothing fits (a valid report)
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return wall


def measure(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {"model": args.model, "budget": args.budget, "hardware": args.hardware,
                              "cli": f"MEMOPT_CACHE_DIR=<fresh dir> python -m memopt.plan model={args.model} "
                                     f"budget={args.budget} hardware={args.hardware} output=json",
                              "cpus": os.cpu_count(), "src": str(args.src or ROOT), "load_before": _load()}
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b, tempfile.TemporaryDirectory() as c:
        result["profile_cold"] = _run_child("profile", args, a)
        with tempfile.TemporaryDirectory() as d:
            result["profile_then_plan_cold"] = _run_child("profile_then_plan", args, d)
        result["plan_cold"] = _run_child("plan", args, b)
        result["plan_cached_profile"] = _run_child("plan", args, b, memo=False)
        result["plan_warm"] = _run_child("plan", args, b)
        result["cli_cold_wall_s"] = _cli_wall(args, c)
        result["cli_cached_profile_wall_s"] = _cli_wall(args, c, memo=False)
        result["cli_warm_wall_s"] = _cli_wall(args, c)
    result["load_after"] = _load()
    return result


def _load() -> list[float]:
    """The 1-, 5- and 15-minute load averages (the machine's cores are shared)."""
    return [round(x, 2) for x in os.getloadavg()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3_70b")
    parser.add_argument("--budget", default="80GB")
    parser.add_argument("--hardware", default="h100_80gb")
    parser.add_argument("--out", default=None)
    parser.add_argument("--src", type=Path, default=None,
                        help="the root of another memopt checkout to time (default: this one)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.model, args.budget, args.hardware)))
        return
    result = measure(args)
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "planner_speed" / f"{args.model}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
