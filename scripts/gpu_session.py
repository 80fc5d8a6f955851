#!/usr/bin/env python
"""One GPU session, most important first, each row in a fresh forked process:

  wrap     memopt.wrap with the CPU-made plans of benchmarks/wrap/plans, under the hard cap (one at a time
           unless --wrap-width says otherwise: concurrent rows share the GPU and their timings are invalid)
  estimator  rows that re-measure changed techniques and models no one tuned for (3 at a time)
  quant    QLoRA (NF4 base + LoRA + paged 8-bit AdamW) and LoRA (bf16 base) rows on two architectures
  speed    --speed-cases (default llama32_1b:40GiB): hand-tuned grid, the plan, and the Hugging Face Trainer
           baseline at the same budget and global batch (one at a time)
  autotune what memopt.wrap(autotune=True) picks for --speed-cases among the candidates made on the CPU
           (scripts/make_wrap_plans.py --autotune), then 5 steps with it (one at a time)
  speed2   one run, interleaved twice, 10 steps each: wrap with autotune, the best hand-tuned grid row and the
           largest Trainer baseline that trained (found by "speed" in session 3), for --speed-cases; timings
           from separate runs differed by 10-20% for the same configuration, so these are compared in one run
  speed3   one run for --speed-cases, new cases included: for a case without a record in SPEED2_REFERENCE it
           first finds, largest first (5 steps a row), the Trainer's largest per-device batch that trains and,
           for checkpointing none/full x expandable segments on/off, the largest micro-batch that trains; then
           --rounds interleaved rounds (--steps each, order rotated each round) of wrap with autotune, the
           fastest grid row of each checkpointing mode and the Trainer's largest batch, for all cases round
           by round; --dry-run predicts the same search on the CPU and prints the jobs and the wall time
  oplog    per-op allocator log of T5 with full checkpointing (diagnosis)

    python scripts/gpu_session.py --out DIR [--deadline 480] [--parts wrap,estimator,quant,speed,oplog]
    python scripts/gpu_session.py --out DIR --parts speed3 --speed-cases qwen25_0_5b:40GiB,llama32_1b:40GiB [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # is_available() must not start CUDA before fork
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import transformers  # noqa: F401

from harness.measure import measure_autotune, measure_row, measure_trainer, measure_wrap
from harness.rows import Row
from harness.wrap_cases import BUDGETS, CASES, HARDWARE, plan_name
from memopt.strategy import Checkpointing, Strategy
from memopt.units import parse_bytes

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = 804044800  # outside the allocator on the H200 (probe), for the hand-tuned rows' cap
START = time.time()


def _child(fn, args, w: int) -> None:
    try:
        out = fn(*args)
    except BaseException as exc:
        out = {"ok": False, "error": repr(exc)}
    os.write(w, json.dumps(out).encode())
    os._exit(0)


def run_pool(jobs: list[tuple], width: int, out_file: Path, deadline: float, timeout: float = 90) -> list[dict]:
    """Run (label, fn, args) jobs in forked children, ``width`` at a time; results appended as JSON lines."""
    pending = list(jobs)
    active: dict[int, tuple] = {}
    results = []
    with out_file.open("a") as f:
        while pending or active:
            while pending and len(active) < width and time.time() < deadline:
                label, fn, args = pending.pop(0)
                r, w = os.pipe()
                pid = os.fork()
                if pid == 0:
                    os.close(r)
                    _child(fn, args, w)
                os.close(w)
                active[pid] = (label, r, [], time.time())
            if not active:
                break
            fds = {v[1]: pid for pid, v in active.items()}
            ready, _, _ = select.select(list(fds), [], [], 0.5)
            for fd in ready:
                pid = fds[fd]
                data = os.read(fd, 1 << 20)
                if data:
                    active[pid][2].append(data)
                    continue
                label, _, chunks, t0 = active.pop(pid)
                os.close(fd)
                os.waitpid(pid, 0)
                res = json.loads(b"".join(chunks).decode()) if chunks else {"ok": False, "error": "no output"}
                res["label"], res["wall_s"] = label, time.time() - t0
                results.append(res)
                f.write(json.dumps(res) + "\n")
                f.flush()
                _print(res)
            for pid, (label, fd, _chunks, t0) in list(active.items()):
                if time.time() - t0 > timeout:
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    os.close(fd)
                    del active[pid]
                    res = {"label": label, "ok": False, "error": f"timeout after {timeout}s"}
                    results.append(res)
                    f.write(json.dumps(res) + "\n")
                    _print(res)
    return results


def _print(res: dict) -> None:
    gib = 2**30
    status = "ok " if res.get("ok") else "ERR"
    if res.get("fits_under_cap") is False or res.get("oom"):
        status = "OOM"
    print(f"{status} {res.get('label', '?'):48s} alloc={res.get('measured_peak_allocated_bytes', 0) / gib:6.2f} "
          f"res={res.get('measured_peak_reserved_bytes', 0) / gib:6.2f} step={res.get('measured_step_s', 0):.3f} "
          f"{str(res.get('error', ''))[:120]}", flush=True)


def wrap_jobs(plans: Path | None = None) -> list[tuple]:
    """The wrap rows: every case's plan in ``plans`` (default ``benchmarks/wrap/plans``; cases without one there
    are skipped)."""
    folder = plans or ROOT / "benchmarks" / "wrap" / "plans"
    jobs = []
    for model, sample in CASES:
        for budget in BUDGETS:
            path = folder / f"{plan_name(model, budget)}.json"
            if not path.exists():
                continue
            row = Row(id=f"wrap/{plan_name(model, budget)}", model=model, steps=5, **sample)
            jobs.append((row.id, measure_wrap, (row, str(path))))
    return jobs


BF16 = Strategy(precision="bf16_autocast", optimizer="adamw_fused")


def estimator_jobs() -> list[tuple]:
    rows = [
        Row(id="llama32_1b/act_offload", model="llama32_1b", batch_size=4, seq_len=2048,
            strategy=BF16.replace(activation_offload=True, micro_batch_size=4), tags=("technique",)),
        Row(id="gpt2_medium/attn_efficient", model="gpt2_medium", batch_size=16, seq_len=1024,
            strategy=BF16.replace(attention="efficient", micro_batch_size=16), tags=("technique",)),
        Row(id="gpt2_medium/attn_flash", model="gpt2_medium", batch_size=16, seq_len=1024,
            strategy=BF16.replace(attention="flash", micro_batch_size=16), tags=("technique",)),
        Row(id="qwen2_1_5b/bf16+fused_adamw", model="qwen2_1_5b", batch_size=4, seq_len=2048,
            strategy=BF16.replace(micro_batch_size=4), tags=("held_out",)),
        Row(id="qwen2_1_5b/full_ac", model="qwen2_1_5b", batch_size=4, seq_len=2048,
            strategy=BF16.replace(micro_batch_size=4, checkpointing=Checkpointing(mode="full")), tags=("held_out",)),
        Row(id="gpt2_large/bf16+fused_adamw", model="gpt2_large", batch_size=8, seq_len=1024,
            strategy=BF16.replace(micro_batch_size=8), tags=("held_out",)),
        Row(id="vit_base/bf16+fused_adamw", model="vit_base", batch_size=128, image_size=224,
            strategy=BF16.replace(micro_batch_size=128), tags=("held_out",)),
        Row(id="llama32_3b/partial_ac_2x2", model="llama32_3b", batch_size=4, seq_len=2048,
            strategy=BF16.replace(micro_batch_size=2, grad_accum_steps=2,
                                  checkpointing=Checkpointing(mode="full", num_blocks=14)), tags=("held_out",)),
    ]
    return [(r.id, measure_row, (r,)) for r in rows]


def quant_rows() -> list[Row]:
    """QLoRA and LoRA on two architectures (issue: quantization and adapters); predicted on the CPU afterwards
    by ``scripts/report_quant.py``."""
    from memopt.techniques.adapters import AdapterSetting
    from memopt.techniques.quantization import qlora, with_extra

    rows = []
    for model, sample in (("llama32_1b", {"batch_size": 8, "seq_len": 2048}),
                          ("qwen25_0_5b", {"batch_size": 8, "seq_len": 2048})):
        base = Strategy(precision="bf16_autocast", micro_batch_size=4, grad_accum_steps=2)
        lora = with_extra(base.replace(precision="bf16_pure", optimizer="adamw_fused"), "adapters",
                          AdapterSetting(kind="lora", r=16, alpha=32))
        for name, s in (("qlora_nf4_r16", qlora(base)), ("lora_bf16_r16", lora),
                        ("qlora_nf4_r16_full_ac", qlora(base.replace(checkpointing=Checkpointing(mode="full"))))):
            rows.append(Row(id=f"quant/{model}/{name}", model=model, steps=5, strategy=s, tags=("quant",), **sample))
    return rows


def quant_jobs() -> list[tuple]:
    return [(r.id, measure_row, (r,)) for r in quant_rows()]


def speed_jobs(model: str, sample: dict, budget: str, budget_bytes: int) -> list[tuple]:
    jobs = []
    path = ROOT / "benchmarks" / "wrap" / "plans" / f"{plan_name(model, budget)}.json"
    row = Row(id=f"speed/{model}_{budget}/plan", model=model, steps=5, **sample)
    jobs.append((row.id, measure_wrap, (row, str(path))))
    g = sample["batch_size"]
    for ac in ("none", "full"):
        for exp in (True, False):
            for mb in (1, 2, 4, 8, 16, 32, 64):
                if g % mb or mb > g or (g >= 32 and mb < 4):  # micro-batches below 4 of a 32+ batch: dominated
                    continue
                jobs.append(grid_job(f"speed/{model}_{budget}", model, budget_bytes, _grid(g, ac, exp, mb), 5))
    for b in (64, 32, 16, 8, 4, 2, 1):
        if g % b or b > g:
            continue
        jobs.append(trainer_job(f"speed/{model}_{budget}", model, budget_bytes, b, 5))
    return jobs


def _grid(g: int, ac: str, exp: bool, mb: int) -> Strategy:
    """A hand-tuned grid configuration: bf16 autocast, fused AdamW, micro-batch ``mb`` of global batch ``g``."""
    return BF16.replace(micro_batch_size=mb, grad_accum_steps=g // mb, expandable_segments=exp,
                        checkpointing=Checkpointing(mode=ac))


def grid_job(tag: str, model: str, budget_bytes: int, s: Strategy, steps: int, suffix: str = "") -> tuple:
    """A grid row under the hard cap: ``{tag}/grid/ac=../exp=../mb=..{suffix}``."""
    label = f"{tag}/grid/ac={s.checkpointing.mode}/exp={int(s.expandable_segments)}/mb={s.micro_batch_size}"
    r = Row(id=label + suffix, model=model, steps=steps, cap_bytes=budget_bytes - RUNTIME, strategy=s,
            tags=("grid",), **dict(CASES)[model])
    return (r.id, measure_row, (r,))


def trainer_job(tag: str, model: str, budget_bytes: int, per_device: int, steps: int, suffix: str = "") -> tuple:
    """The Trainer baseline at ``per_device`` with accumulation to the global batch: ``{tag}/trainer/pd=..``."""
    sample = dict(CASES)[model]
    r = Row(id=f"{tag}/trainer/pd={per_device}{suffix}", model=model, steps=steps, tags=("trainer",), **sample)
    return (r.id, measure_trainer, (r, per_device, sample["batch_size"] // per_device, budget_bytes - RUNTIME))


# the best grid row and the Trainer's largest per-device batch that trained, from benchmarks/wrap (session 3)
SPEED2_REFERENCE = {
    "llama32_1b:40GiB": (BF16.replace(micro_batch_size=2, grad_accum_steps=4, expandable_segments=False), 4),
    "bert_large:24GiB": (BF16.replace(micro_batch_size=16, grad_accum_steps=2, expandable_segments=True), 32),
}


def speed2_jobs(case: str, rounds: int = 2, steps: int = 10) -> list[tuple]:
    model, budget = case.split(":")
    sample = dict(CASES)[model]
    budget_bytes = parse_bytes(budget)
    grid, per_device = SPEED2_REFERENCE[case]
    folder = ROOT / "benchmarks" / "wrap" / "plans" / "autotune" / plan_name(model, budget)
    paths = [str(p) for p in sorted(folder.glob("*.json"))]
    g = sample["batch_size"]
    jobs = []
    for k in range(rounds):
        tag = f"speed2/{model}_{budget}"
        tuned = Row(id=f"{tag}/plan+autotune/r{k}", model=model, steps=steps, **sample)
        best = Row(id=f"{tag}/grid_best/r{k}", model=model, steps=steps, cap_bytes=budget_bytes - RUNTIME,
                   strategy=grid, tags=("grid",), **sample)
        trainer = Row(id=f"{tag}/trainer/pd={per_device}/r{k}", model=model, steps=steps, tags=("trainer",), **sample)
        jobs += [(tuned.id, measure_autotune, (tuned, paths)), (best.id, measure_row, (best,)),
                 (trainer.id, measure_trainer, (trainer, per_device, g // per_device, budget_bytes - RUNTIME))]
    return jobs


SIZES = (64, 32, 16, 8, 4, 2, 1)


def _trained(res: dict | None) -> bool:
    """A row trained its steps under the hard cap (measure_row: ok; wrap and Trainer rows: fits_under_cap)."""
    return bool(res and res.get("ok") and not res.get("oom") and not res.get("skipped")
                and res.get("fits_under_cap", True))


def speed3_find(case: str, out_file: Path, deadline: float, next_smaller: bool = False, pool=run_pool) -> dict:
    """What a new speed case has no record of, found in this run, largest first (5 steps a row, fresh process):
    the Trainer's largest per-device batch that trains; for each checkpointing (none, full) x expandable segments
    (on, off) the largest micro-batch dividing the global batch that trains -- and the next smaller one when
    ``next_smaller`` or when that row needed allocator retries (memory pressure can make the next smaller
    faster). Returns the fastest grid configuration of each checkpointing mode and the Trainer's per-device
    batch, for ``speed3_round``."""
    model, budget = case.split(":")
    g, budget_bytes = dict(CASES)[model]["batch_size"], parse_bytes(budget)
    tag = f"speed3/{model}_{budget}/find"
    sizes = [b for b in SIZES if b <= g and g % b == 0]

    def run(job: tuple) -> dict | None:
        res = pool([job], 1, out_file, deadline, timeout=120)
        return res[0] if res else None

    per_device = next((b for b in sizes if _trained(run(trainer_job(tag, model, budget_bytes, b, 5)))), None)
    best: dict[str, tuple[float, Strategy]] = {}
    for ac in ("none", "full"):
        for exp in (True, False):
            for i, mb in enumerate(sizes):
                res = run(grid_job(tag, model, budget_bytes, _grid(g, ac, exp, mb), 5))
                if res is None:  # past the deadline
                    break
                if not _trained(res):
                    continue
                tried = [(res["measured_step_s"], _grid(g, ac, exp, mb))]
                if (next_smaller or res.get("num_alloc_retries")) and i + 1 < len(sizes):
                    smaller = _grid(g, ac, exp, sizes[i + 1])
                    res = run(grid_job(tag, model, budget_bytes, smaller, 5))
                    if _trained(res):
                        tried.append((res["measured_step_s"], smaller))
                tried += [best[ac]] if ac in best else []
                best[ac] = min(tried, key=lambda t: t[0])
                break
    return {"grid": [s for _, s in best.values()], "per_device": per_device}


def speed3_round(case: str, found: dict, k: int, steps: int) -> list[tuple]:
    """Round ``k`` of one case: memopt.wrap with autotune, the grid rows found and the Trainer's largest batch,
    ``steps`` steps each, the order rotated by one each round so no configuration always runs first."""
    model, budget = case.split(":")
    budget_bytes = parse_bytes(budget)
    tag = f"speed3/{model}_{budget}"
    folder = ROOT / "benchmarks" / "wrap" / "plans" / "autotune" / plan_name(model, budget)
    tuned = Row(id=f"{tag}/plan+autotune/r{k}", model=model, steps=steps, **dict(CASES)[model])
    jobs = [(tuned.id, measure_autotune, (tuned, [str(p) for p in sorted(folder.glob("*.json"))]))]
    jobs += [grid_job(tag, model, budget_bytes, s, steps, f"/r{k}") for s in found["grid"]]
    if found["per_device"]:
        jobs.append(trainer_job(tag, model, budget_bytes, found["per_device"], steps, f"/r{k}"))
    return jobs[k % len(jobs):] + jobs[:k % len(jobs)]


def speed3(cases: list[str], out_file: Path, deadline: float, rounds: int, steps: int, rediscover: bool,
           next_smaller: bool, pool=run_pool, now=time.time) -> None:
    """For each case first memopt's plan as memopt.wrap applies it (5 steps: does its micro-batch train under
    the cap?); cases with a record in SPEED2_REFERENCE reuse it unless ``rediscover``, the others are found
    (speed3_find). Then ``rounds`` rounds over all cases, round by round, so a deadline cuts whole rounds;
    a round starts only if the previous one would still finish before the deadline."""
    missing = [c for c in cases if not any((ROOT / "benchmarks" / "wrap" / "plans" / "autotune"
                                            / plan_name(*c.split(":"))).glob("*.json"))]
    if missing:
        raise SystemExit(f"speed3: no autotune candidates for {missing}: scripts/make_wrap_plans.py --autotune "
                         + ",".join(missing))
    found = {}
    for case in cases:
        model, budget = case.split(":")
        plan = Row(id=f"speed3/{model}_{budget}/find/plan", model=model, steps=5, **dict(CASES)[model])
        path = ROOT / "benchmarks" / "wrap" / "plans" / f"{plan_name(model, budget)}.json"
        pool([(plan.id, measure_wrap, (plan, str(path)))], 1, out_file, deadline, timeout=120)
        if case in SPEED2_REFERENCE and not rediscover:
            grid, per_device = SPEED2_REFERENCE[case]
            found[case] = {"grid": [grid], "per_device": per_device}
        else:
            found[case] = speed3_find(case, out_file, deadline, next_smaller, pool)
        print(f"speed3 {case}: grid {[s.label() for s in found[case]['grid']]}, "
              f"Trainer per-device batch {found[case]['per_device']}", flush=True)
    last = 0.0
    for k in range(rounds):
        if now() + last > deadline:
            print(f"speed3: round {k} not started (the last round took {last:.0f} s; deadline)", flush=True)
            break
        t = now()
        pool([j for case in cases for j in speed3_round(case, found[case], k, steps)], 1, out_file, deadline,
             timeout=180)
        last = now() - t


# seconds a row spends outside its timed steps (fork, CUDA start, model build, data; the Trainer's set-up; the
# autotune trials), from the wall_s of sessions 3-4 in benchmarks/wrap/raw: for the --dry-run estimate only
OVERHEAD_S = {"measure_row": 7.0, "measure_trainer": 11.0, "measure_autotune": 12.0, "measure_wrap": 7.0}


class DryRun:
    """``--dry-run``: each job is predicted on the CPU instead of run, through the same job lists and search:
    a row trains if memopt.estimate's reserved peak fits its cap (the Trainer: full checkpointing, default
    allocator, per-device batch); its wall time is OVERHEAD_S plus steps x the predicted step time."""

    def __init__(self) -> None:
        self.elapsed = 0.0
        self.profiles: dict[str, object] = {}

    def now(self) -> float:
        return START + self.elapsed

    def _estimate(self, row: Row, s: Strategy):
        import memopt

        if row.model not in self.profiles:
            self.profiles[row.model] = memopt.profile(row.model, row.sample(), hardware=HARDWARE)
        return memopt.estimate(self.profiles[row.model], s)

    def predict(self, label: str, fn, args: tuple) -> dict:
        row = args[0]
        if fn is measure_trainer:
            e = self._estimate(row, _grid(row.batch_size, "full", False, args[1]))
            trains, step = e.peak_reserved_bytes <= args[3], e.step_time_s
        elif fn is measure_row:
            e = self._estimate(row, row.strategy)
            trains, step = e.peak_reserved_bytes <= row.cap_bytes, e.step_time_s
        else:  # memopt's plans say themselves whether they fit
            data = json.loads(Path(args[1] if fn is measure_wrap else args[1][0]).read_text())
            trains, step = data["fits"], data["step_time_s"]
        wall = OVERHEAD_S[fn.__name__] + (row.steps if trains else 1) * step
        res = {"label": label, "row": row.to_dict(), "ok": trains, "oom": not trains, "fits_under_cap": trains,
               "dry_run": True, "measured_step_s": step if trains else 0.0, "num_alloc_retries": 0, "wall_s": wall}
        if fn is measure_trainer:
            res["per_device_batch"] = args[1]
        elif fn is not measure_row:
            res["strategy"] = data["strategy_label"]
        return res

    def pool(self, jobs: list[tuple], width: int, out_file: Path, deadline: float, timeout: float = 90) -> list[dict]:
        results = []
        for label, fn, args in jobs:
            if self.now() > deadline:
                break
            res = self.predict(label, fn, args)
            self.elapsed += res["wall_s"]
            results.append(res)
            with out_file.open("a") as f:
                f.write(json.dumps(res) + "\n")
            print(f"{self.elapsed:5.0f}s (+{res['wall_s']:4.1f}) ", end="")
            _print(res)
        return results


def oplog_job() -> list[tuple]:
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_probe

    strategy = {"precision": "bf16_autocast", "optimizer": "adamw_fused", "micro_batch_size": 4,
                "checkpointing": {"mode": "full", "num_blocks": None}}
    return [("oplog/t5_full_ac", gpu_probe.op_log, ("t5_base", {"batch_size": 4, "seq_len": 512},
                                                     {"num_layers": 4, "num_decoder_layers": 4}, strategy))]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--deadline", type=float, default=480.0, help="seconds: start nothing new after this")
    parser.add_argument("--parts", default="wrap,estimator,quant,speed,oplog")
    parser.add_argument("--wrap-plans", type=Path, default=None,
                        help="folder of the plans the wrap part runs (default benchmarks/wrap/plans)")
    parser.add_argument("--wrap-width", type=int, default=1, help="wrap rows at a time (>1 invalidates timings)")
    parser.add_argument("--speed-cases", default="llama32_1b:40GiB",
                        help="MODEL:BUDGET,... among the wrap cases (global batch from harness.wrap_cases)")
    parser.add_argument("--rounds", type=int, default=3, help="speed3: interleaved rounds")
    parser.add_argument("--steps", type=int, default=10, help="speed3: steps a row in the rounds")
    parser.add_argument("--rediscover", action="store_true",
                        help="speed3: find the grid and Trainer rows also for cases recorded in SPEED2_REFERENCE")
    parser.add_argument("--next-smaller", action="store_true",
                        help="speed3: also the next smaller micro-batch of each grid series")
    parser.add_argument("--dry-run", action="store_true",
                        help="speed3 on the CPU: the jobs, predicted by memopt.estimate, and the wall time")
    args = parser.parse_args()
    speed3_args = (args.speed_cases.split(","), args.rounds, args.steps, args.rediscover, args.next_smaller)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:  # predicted rows go to speed3_dry_run.jsonl (report_wrap.py marks them as predicted)
        dry = DryRun()
        cases, *rest = speed3_args
        (out / "speed3_dry_run.jsonl").unlink(missing_ok=True)
        speed3(cases, out / "speed3_dry_run.jsonl", START + args.deadline, *rest, pool=dry.pool, now=dry.now)
        print(f"dry run: about {dry.elapsed:.0f}s of rows (deadline {args.deadline:.0f}s)")
        return 0
    if not torch.cuda.is_available():
        print("gpu_session.py needs a CUDA GPU")
        return 2
    deadline = START + args.deadline
    parts = args.parts.split(",")
    if "wrap" in parts:
        run_pool(wrap_jobs(args.wrap_plans), args.wrap_width, out / "wrap.jsonl", deadline)
    if "quant" in parts:
        run_pool(quant_jobs(), 1, out / "quant.jsonl", deadline)
    if "estimator" in parts:
        run_pool(estimator_jobs(), 3, out / "estimator_run2.jsonl", deadline)
    if "speed" in parts:
        for case in args.speed_cases.split(","):
            model, budget = case.split(":")
            sample = dict(CASES)[model]
            budget_bytes = parse_bytes(budget)
            jobs = speed_jobs(model, sample, budget, budget_bytes)
            # one at a time (timings); skip larger micro-batches of a series once one ran out of memory
            failed: set[str] = set()
            for label, fn, fargs in jobs:
                series = label.rsplit("/mb=", 1)[0] if "/grid/" in label else None
                if series in failed or time.time() > deadline:
                    continue
                res = run_pool([(label, fn, fargs)], 1, out / "speed.jsonl", deadline)
                if series and (not res or res[0].get("oom") or not res[0].get("ok")):
                    failed.add(series)
                if "/trainer/" in label and res and res[0].get("fits_under_cap"):
                    break  # the largest per-device batch that fits has been found
    if "autotune" in parts:
        for case in args.speed_cases.split(","):
            model, budget = case.split(":")
            folder = ROOT / "benchmarks" / "wrap" / "plans" / "autotune" / plan_name(model, budget)
            paths = [str(p) for p in sorted(folder.glob("*.json"))]
            row = Row(id=f"speed/{model}_{budget}/plan+autotune", model=model, steps=5, **dict(CASES)[model])
            run_pool([(row.id, measure_autotune, (row, paths))], 1, out / "speed_autotune.jsonl", deadline,
                     timeout=180)
    if "speed2" in parts:
        for case in args.speed_cases.split(","):
            run_pool(speed2_jobs(case), 1, out / "speed2.jsonl", deadline, timeout=180)
    if "speed3" in parts:
        cases, *rest = speed3_args
        speed3(cases, out / "speed3.jsonl", deadline, *rest)
    if "oplog" in parts and time.time() < deadline:
        res = run_pool(oplog_job(), 1, out / "oplog_raw.jsonl", deadline, timeout=120)
        if res:
            import gzip

            with gzip.open(out / "ops_t5_full_ac.json.gz", "wt") as f:
                json.dump(res, f)
            (out / "oplog_raw.jsonl").unlink(missing_ok=True)
    print(f"done in {time.time() - START:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
