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
  oplog    per-op allocator log of T5 with full checkpointing (diagnosis)

    python scripts/gpu_session.py --out DIR [--deadline 480] [--parts wrap,estimator,quant,speed,oplog]
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

from memopt.strategy import Checkpointing, Strategy
from memopt.units import parse_bytes
from memopt.validation.measure import measure_autotune, measure_row, measure_trainer, measure_wrap
from memopt.validation.rows import Row
from memopt.validation.wrap_cases import BUDGETS, CASES, plan_name

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


def wrap_jobs() -> list[tuple]:
    jobs = []
    for model, sample in CASES:
        for budget in BUDGETS:
            path = ROOT / "benchmarks" / "wrap" / "plans" / f"{plan_name(model, budget)}.json"
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
                s = BF16.replace(micro_batch_size=mb, grad_accum_steps=g // mb, expandable_segments=exp,
                                 checkpointing=Checkpointing(mode=ac))
                r = Row(id=f"speed/{model}_{budget}/grid/ac={ac}/exp={int(exp)}/mb={mb}", model=model, steps=5,
                        cap_bytes=budget_bytes - RUNTIME, strategy=s, tags=("grid",), **sample)
                jobs.append((r.id, measure_row, (r,)))
    for b in (64, 32, 16, 8, 4, 2, 1):
        if g % b or b > g:
            continue
        r = Row(id=f"speed/{model}_{budget}/trainer/pd={b}", model=model, steps=5, tags=("trainer",), **sample)
        jobs.append((r.id, measure_trainer, (r, b, g // b, budget_bytes - RUNTIME)))
    return jobs


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
    parser.add_argument("--wrap-width", type=int, default=1, help="wrap rows at a time (>1 invalidates timings)")
    parser.add_argument("--speed-cases", default="llama32_1b:40GiB",
                        help="MODEL:BUDGET,... among the wrap cases (global batch from memopt.validation.wrap_cases)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_session.py needs a CUDA GPU")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = START + args.deadline
    parts = args.parts.split(",")
    if "wrap" in parts:
        run_pool(wrap_jobs(), args.wrap_width, out / "wrap.jsonl", deadline)
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
