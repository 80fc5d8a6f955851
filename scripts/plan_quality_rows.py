#!/usr/bin/env python
"""Gather every single-GPU step time measured on the H200 beside the prediction made for it, into one dataset:

    python scripts/plan_quality_rows.py --out benchmarks/plan_quality/clock_rows.json

Each row names its model so that it can be rebuilt on the CPU (a shipped config with overrides, or a row of
``scripts/zoo_matrix_gpu.py`` built from its transformers config), its sample, its strategy, the measured step, the
prediction recorded when it was measured, and where it came from (``source``: file and line, or the issue).

``timing_valid`` is False where the run shared the GPU with other rows (``benchmarks/wrap/raw/wrap.jsonl`` ran 3
rows at a time, the any-model zoo 6): such a step time says how the clock does under contention, not what the
GPU does, so the fit leaves those rows out. ``measured_kind`` is ``step`` (median step after warm-up) or
``autotune`` (memopt's autotune trial: forward and backward of every micro-batch measured, plus the plan's predicted
optimizer time). Rows of engines that own the step (DeepSpeed ZeRO, FSDP2, one-GPU offload), of the Trainer path
and of adapters / quantized models are left out: their clocks are ``memopt/distributed/timing.py`` and the quant
benchmarks'.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memopt.strategy import PRECISIONS  # noqa: E402
from memopt.techniques.optimizers import OPTIMIZER_NAMES as OPTIMIZERS  # noqa: E402

# rows of these files ran beside others on the same GPU
CONCURRENT = {"benchmarks/wrap/raw/wrap.jsonl": "3 rows at a time",
              # benchmarks/validation/estimator_h200.md marks these 8 rows' step times as measured beside other rows
              "benchmarks/validation/raw/estimator_h200_run2.jsonl": "beside other rows",
              "benchmarks/any_model/raw/zoo_s10_baseline_before_fixes.jsonl": "6 rows at a time",
              "benchmarks/any_model/raw/zoo_s10_call3.jsonl": "6 rows at a time"}
ZOO_FILES = ("benchmarks/any_model/raw/zoo_s10_baseline_before_fixes.jsonl",
             "benchmarks/any_model/raw/zoo_s10_call3.jsonl")


def parse_label(label: str) -> dict[str, Any] | None:
    """A strategy dict from ``Strategy.label()``; None for labels with extras (sharding, adapters, quantization)."""
    parts = label.split()
    if len(parts) < 5 or parts[0] not in PRECISIONS or parts[3] not in OPTIMIZERS:
        return None
    s: dict[str, Any] = {"precision": parts[0], "optimizer": parts[3], "activation_offload": False,
                         "attention": "auto", "chunked_ce": 0, "extras": {}}
    ac = re.fullmatch(r"ac=(none|full|selective)(?:\[(\d+)\])?", parts[1])
    mb = re.fullmatch(r"mb=(\d+)x(\d+)", parts[2])
    if ac is None or mb is None:
        return None
    s["checkpointing"] = {"mode": ac.group(1), "num_blocks": int(ac.group(2)) if ac.group(2) else None}
    s["micro_batch_size"], s["grad_accum_steps"] = int(mb.group(1)), int(mb.group(2))
    rest = parts[4:]
    for tok in rest:
        if tok == "act-offload":
            s["activation_offload"] = True
        elif tok.startswith("attn="):
            s["attention"] = tok[5:]
        elif tok.startswith("chunked-ce="):
            s["chunked_ce"] = int(tok[11:])
        elif tok in ("expandable", "default-alloc"):
            s["expandable_segments"] = tok == "expandable"
        else:
            return None
    return s if "expandable_segments" in s else None


def _shipped(r: dict[str, Any]) -> dict[str, Any]:
    row = r["row"]
    return {"kind": "config", "name": row["model"], "overrides": row.get("overrides") or {}}


def _sample(row: dict[str, Any]) -> dict[str, Any]:
    out = {"batch_size": row["batch_size"]}
    for k in ("seq_len", "image_size"):
        if row.get(k):
            out[k] = row[k]
    return out


def _strategy_of(r: dict[str, Any]) -> dict[str, Any] | None:
    """The strategy that ran: the plan's label where a plan was applied (autotune may have changed it), else the
    row's own strategy."""
    if r.get("plan") or (r.get("strategy") and isinstance(r["strategy"], str)):
        return parse_label(r["strategy"]) if isinstance(r.get("strategy"), str) else None
    strat = r["row"]["strategy"]
    if strat.get("extras"):
        return None
    return strat


def wrap_style(path: Path) -> list[dict[str, Any]]:
    """Rows written by gpu_session.py / validate_gpu.py: ``row`` (model, sample, strategy), ``measured_step_s``."""
    rel = str(path.relative_to(ROOT))
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        r = json.loads(line)
        row = r.get("row")
        if not isinstance(row, dict) or not r.get("ok") or not r.get("measured_step_s") or "trainer" in row["id"]:
            continue
        if "trainer" in (row.get("tags") or []):
            continue
        strat = _strategy_of(r)
        if strat is None:
            continue
        base = {"model": _shipped(r), "sample": _sample(row), "hardware": row.get("hardware", "h200"),
                "timing_valid": rel not in CONCURRENT, "concurrency": CONCURRENT.get(rel, "one row at a time")}
        out.append({"id": row["id"], **base, "strategy": strat, "measured_step_s": r["measured_step_s"],
                    "measured_kind": "step", "old_predicted_step_s": r.get("predicted_step_s"),
                    "source": f"{rel}:{n}"})
        out += _trials(row["id"], base, r.get("trials"), f"{rel}:{n} trials")
    return out


def _trials(row_id: str, base: dict[str, Any], trials: list[dict[str, Any]] | None,
            source: str) -> list[dict[str, Any]]:
    """The autotune's measured candidates of one row, each as a row of its own."""
    out = []
    for k, t in enumerate(trials or []):
        s = parse_label(t["strategy"])
        if s is None or t.get("score_s") is None:
            continue
        out.append({"id": f"{row_id}/autotune{k}", **base, "strategy": s, "measured_step_s": t["score_s"],
                    "measured_kind": "autotune", "old_predicted_step_s": t["predicted_step_s"],
                    "source": f"{source}[{k}]"})
    return out


def zoo(path: Path) -> list[dict[str, Any]]:
    rel = str(path.relative_to(ROOT))
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        r = json.loads(line)
        base = {"model": {"kind": "zoo", "row": r["id"]}, "sample": {"batch_size": r["batch_size"],
                                                                     "seq_len": r["seq_len"]},
                "hardware": "h200", "timing_valid": False, "concurrency": CONCURRENT[rel]}
        if r.get("measured_step_s") and r.get("final_plan"):
            s = parse_label(r["final_plan"])
            if s is not None:
                out.append({"id": r["id"], **base, "strategy": s, "measured_step_s": r["measured_step_s"],
                            "measured_kind": "step", "old_predicted_step_s": r.get("predicted_step_s"),
                            "source": f"{rel}:{n}"})
        out += _trials(r["id"], base, r.get("autotune_trials"), f"{rel}:{n} autotune_trials")
    return out


def _issue(id: str, zoo_row: str, b: int, s: int, label: str, pred: float, meas: float, note: str) -> dict[str, Any]:
    return {"id": f"issue20/{id}", "model": {"kind": "zoo", "row": zoo_row}, "sample": {"batch_size": b, "seq_len": s},
            "hardware": "h200", "strategy": parse_label(label), "measured_step_s": meas, "measured_kind": "autotune",
            "old_predicted_step_s": pred, "timing_valid": None, "concurrency": "unknown (run not committed)",
            "source": f"issue 20 figures; {note}"}


# Figures of issue 20 whose runs are not in the repo. The strategies are the autotune candidates that the committed
# zoo baseline (zoo_s10_baseline_before_fixes.jsonl) recorded for the same row with the same predicted step time.
ISSUE_ROWS = [
    _issue("tinyllama-selective", "tinyllama1.1b-16x2048-24GiB", 16, 2048,
           "bf16_autocast ac=selective mb=1x16 adamw_fused expandable", 1.524, 4.467,
           "the baseline zoo run measured the same candidate at 4.049 s"),
    _issue("tinyllama-act-offload", "tinyllama1.1b-16x2048-24GiB", 16, 2048,
           "bf16_autocast ac=none mb=4x4 adamw_fused act-offload expandable", 1.587, 4.541,
           "the baseline zoo run measured the same candidate at 4.557 s"),
]


def _unrecorded(id: str, what: str, pred: float, meas: float) -> dict[str, Any]:
    return {"id": f"issue20/{id}", "model": {"kind": "described", "what": what}, "sample": None, "hardware": "h200",
            "strategy": None, "measured_step_s": meas, "measured_kind": "unknown", "old_predicted_step_s": pred,
            "timing_valid": None, "concurrency": "unknown (run not committed)",
            "source": "issue 20 figures; strategy not recorded, so not re-predicted"}


# issue 20's other figures: no committed row says which strategy ran
ISSUE_ROWS += [
    _unrecorded("pythia410m-selective-a", "GPT-NeoX 410M (Pythia-410m shape), selective checkpointing", 0.640, 1.757),
    _unrecorded("pythia410m-selective-b", "GPT-NeoX 410M (Pythia-410m shape), selective checkpointing", 0.654, 2.425),
    _unrecorded("resnet50-b128", "torchvision ResNet-50, batch 128", 0.023, 0.057),
    _unrecorded("pythia410m", "GPT-NeoX 410M (Pythia-410m shape)", 0.444, 0.742),
    _unrecorded("gemma2-2b-selective-8bit", "Gemma-2-2B shape, selective checkpointing, 8-bit AdamW", 0.659, 1.515),
    _unrecorded("phi3-mini", "Phi-3-mini shape (3.8B)", 0.630, 0.617),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/plan_quality/clock_rows.json")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    for path in sorted((ROOT / "benchmarks").rglob("*.jsonl")):
        rel = str(path.relative_to(ROOT))
        if rel in ZOO_FILES:
            rows += zoo(path)
        elif rel.startswith(("benchmarks/wrap/", "benchmarks/validation/", "benchmarks/sharding/")):
            rows += wrap_style(path)
    rows += ISSUE_ROWS
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "command": "python scripts/plan_quality_rows.py"}, indent=1) + "\n")
    valid = sum(1 for r in rows if r["timing_valid"])
    print(f"{len(rows)} rows ({valid} measured one row at a time) -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
