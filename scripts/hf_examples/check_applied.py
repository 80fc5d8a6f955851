"""Did the run do what memopt's plan said? And do two runs' losses agree?

Everything is judged from what the probe (``launch.py``) saw while the script trained, not from the arguments
memopt set: each forward's batch and autocast state, the blocks that ran their layers twice (recomputed in
backward: checkpointed), the optimizer the Trainer built, and on a GPU the allocator's segment mode.
"""

from __future__ import annotations

import itertools
from typing import Any

__all__ = ["compare_losses", "plan_applied"]

TRAINER_OPTIM = {"adamw_fused": "adamw_torch_fused", "adamw_foreach": "adamw_torch", "adamw": "adamw_torch",
                 "adamw8bit": "adamw_bnb_8bit", "paged_adamw8bit": "paged_adamw_8bit", "sgd": "sgd"}
ACCELERATE = {"bf16_autocast": "bf16", "fp16_autocast": "fp16", "fp32": "no"}
MATMUL_DTYPE = {"bf16_autocast": "bfloat16", "fp16_autocast": "float16", "fp32": "float32"}
# losses of two runs that do the same arithmetic in another order (micro-batches, fused vs foreach AdamW)
TOLERANCE = {"fp32": 1e-4, "bf16_autocast": 2e-2, "fp16_autocast": 2e-2}


def _expected_checkpointed(strategy: dict[str, Any], blocks: dict[str, int]) -> list[str]:
    from memopt.strategy import Checkpointing

    c = strategy["checkpointing"]
    setting = Checkpointing(mode=c["mode"], num_blocks=c.get("num_blocks"))
    return sorted(f"{path}.{i}" for path, n in blocks.items() for i in setting.blocks(n))


def plan_applied(record: dict[str, Any]) -> dict[str, Any]:
    """Per technique of the plan: what it said, what ran, and whether they agree (None: cannot be seen here)."""
    s = record.get("strategy")
    steps = record.get("steps") or []
    if not s or not steps:
        return {"all": False, "why": record.get("error") or "no plan or no step recorded"}
    trainer = record["trainer"]
    checks: dict[str, dict[str, Any]] = {}
    replans = [{"step": st["step"], "to": st["strategy"]} for prev, st in itertools.pairwise(steps)
               if st.get("strategy") and prev.get("strategy") and st["strategy"] != prev["strategy"]]
    if replans:  # the guard re-planned (an out-of-memory error recovered): judge the plan it started with
        steps = [st for st in steps if st["step"] < replans[0]["step"]]
    micro = sorted({f["batch"] for st in steps for f in st["forwards"]})
    per_step = sorted({len(st["forwards"]) for st in steps})
    checks["micro_batches"] = {"plan": f"{s['grad_accum_steps']} x {s['micro_batch_size']}",
                               "ran": f"{per_step} x {micro}",
                               "ok": all(_micro_batches_as_planned([f["batch"] for f in st["forwards"]], s)
                                         for st in steps)}
    seen = sorted({str(f["matmul_dtype"]) for st in steps for f in st["forwards"]})
    checks["precision"] = {"plan": s["precision"],
                           "ran": f"linear layers compute in {', '.join(seen)}; accelerator mixed precision "
                                  f"{trainer['accelerator_mixed_precision']}",
                           "ok": seen == [MATMUL_DTYPE[s["precision"]]]
                           and trainer["accelerator_mixed_precision"] == ACCELERATE[s["precision"]]}
    optim_ok = trainer["optim"] == TRAINER_OPTIM[s["optimizer"]]
    if s["optimizer"].startswith("adamw"):
        optim_ok = optim_ok and trainer["optimizer_class"] == "AdamW" and (
            trainer["optimizer_fused"] == (s["optimizer"] == "adamw_fused"))
    checks["optimizer"] = {"plan": s["optimizer"],
                           "ran": f"{trainer['optimizer_class']} (optim={trainer['optim']}, "
                                  f"fused={trainer['optimizer_fused']})", "ok": optim_ok}
    expected = _expected_checkpointed(s, record.get("blocks", {}))
    ran = sorted({tuple(st["recomputed_blocks"]) for st in steps})
    c = s["checkpointing"]
    checks["checkpointing"] = {"plan": c["mode"] if c.get("num_blocks") is None else f"{c['mode']}[{c['num_blocks']}]",
                               "ran": f"{len(ran[0]) if len(ran) == 1 else ran} of {sum(record['blocks'].values())} "
                                      "blocks recomputed",
                               "ok": ran == [tuple(expected)] and not trainer["gradient_checkpointing"]}
    in_force = record.get("expandable_segments_in_force")
    checks["allocator"] = {"plan": f"expandable_segments={s['expandable_segments']}",
                           "ran": "no CUDA allocator (CPU)" if "expandable_segments_in_force" not in record
                           else f"expandable_segments={in_force}",
                           "ok": None if "expandable_segments_in_force" not in record
                           else in_force == s["expandable_segments"]}
    out = {"all": all(v["ok"] is not False for v in checks.values()) and not replans, "checks": checks}
    if replans:
        out["replans"] = [{"step": r["step"], "to": _label(r["to"])} for r in replans]
    return out


def _label(strategy: dict[str, Any]) -> str:
    from memopt.strategy import Strategy

    return Strategy.from_dict(strategy).label()


def _micro_batches_as_planned(batches: list[int], s: dict[str, Any]) -> bool:
    """The step's forwards are the plan's micro-batches: ``grad_accum_steps`` of ``micro_batch_size``, or for a
    short batch (an epoch's last) as many full ones as it holds and the rest."""
    mb, total = s["micro_batch_size"], sum(batches)
    if total >= mb * s["grad_accum_steps"]:
        return batches == [mb] * s["grad_accum_steps"]
    full, rest = divmod(total, mb)
    return batches == [mb] * full + ([rest] if rest else [])


def _losses(record: dict[str, Any]) -> list[float]:
    return [row["loss"] for row in sorted(record.get("losses") or [], key=lambda r: r["step"])]


def compare_losses(a: dict[str, Any], b: dict[str, Any], strategy: dict[str, Any] | None) -> dict[str, Any]:
    """Step-by-step losses of ``a`` and ``b``, their largest relative difference and whether it is within the
    tolerance of the plan's precision."""
    la, lb = _losses(a), _losses(b)
    precision = (strategy or {}).get("precision", "fp32")
    out: dict[str, Any] = {"losses": la, "against": lb, "tolerance": TOLERANCE[precision]}
    if not la or len(la) != len(lb):
        return {**out, "equal": False, "why": f"{len(la)} losses against {len(lb)}"}
    rel = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(la, lb))
    return {**out, "max_rel_diff": rel, "equal": rel <= TOLERANCE[precision]}
