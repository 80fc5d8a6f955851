"""GPU validation cases for sharding and offload (issue 5), and their per-GPU predictions made on the CPU.

A ``ShardedCase`` is plain data (JSON round trip) naming a model, a global batch, an engine setting
(DeepSpeed ZeRO-2/3 or FSDP2, CPU offload), checkpointing, a micro-batch and a hard per-GPU cap. The
GPU side (``harness.measure_sharded``) runs it; ``predict_case`` says what memopt expects, with the
library's sharded estimate (``memopt.distributed.estimate``: the activation timeline joined with the engine's
bytes at each point, reserved bytes per allocator pool, and the step time) -- the same one the planner uses.
Reserved is modelled per allocator pool (one per CUDA stream); the default allocator's extra fragmentation
between its segments, which the hand-written baselines have, is not.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from memopt.distributed import engine_bytes, timeline
from memopt.distributed import estimate as est
from memopt.distributed.engine_bytes import EngineRun
from memopt.distributed.estimate import ENGINE_PRECISION
from memopt.distributed.timeline import TimelinePoint
from memopt.profile.engine_facts import ModelFacts, model_facts
from memopt.strategy import Checkpointing, Strategy
from memopt.units import GiB

__all__ = [
    "ENGINE_PRECISION",
    "ModelFacts",
    "ShardedCase",
    "TimelinePoint",
    "activation_timeline",
    "case_deepspeed_config",
    "choose_memopt_setting",
    "diagnostic_fsdp2_cases",
    "engine_bytes_at",
    "model_facts",
    "predict_case",
    "report_rows",
    "single_gpu_cases",
    "two_gpu_cases",
]

ROLES = ("memopt", "baseline", "diag")
#: the fraction of the cap memopt plans to (the rest: allocator rounding, NCCL/engine allocations not modelled)
PLAN_HEADROOM = 0.95


@dataclass(frozen=True, kw_only=True)
class ShardedCase:
    """One measured configuration.

    ``role``: "memopt" (memopt chose checkpointing and micro-batch), "baseline" (a hand-written
    configuration as users write it) or "diag" (a fixed configuration measured to test the estimate).
    ``ckpt_impl``: "memopt" (``apply_checkpointing`` on the blocks) or "hf"
    (``model.gradient_checkpointing_enable``). ``ds_defaults``: leave DeepSpeed's bucket, prefetch and overlap
    settings at their defaults (the baseline) instead of memopt's ``deepspeed_config``.
    ``micro_batch_candidates``: for a baseline, the micro-batches tried largest first, each in a fresh
    process, until one fits (``micro_batch`` is then the first candidate).
    """

    id: str
    model: str = "llama32_3b"
    engine: str = "deepspeed"  # "deepspeed" or "fsdp2"
    stage: int = 3
    offload_optimizer: str = "none"
    offload_params: str = "none"
    world_size: int = 1
    cap_bytes: int = 16 * GiB
    global_batch: int = 8
    seq_len: int = 2048
    micro_batch: int = 1
    checkpointing: Checkpointing = field(default_factory=lambda: Checkpointing(mode="full"))
    ckpt_impl: str = "memopt"
    expandable_segments: bool = True
    role: str = "memopt"
    ds_defaults: bool = False
    steps: int = 3
    hardware: str = "h200"
    micro_batch_candidates: tuple[int, ...] = ()
    fsdp_optimizer: str = "fused"  # torch AdamW on the CPU shards: "fused" or "foreach"
    compare_to: str = ""  # the baseline id a memopt case's speed is compared with
    nvme_path: str | None = None  # ZeRO-Infinity's swap directory (offload_* = "nvme")

    def __post_init__(self) -> None:
        problems = []
        if self.engine not in ("deepspeed", "fsdp2"):
            problems.append(f"engine must be 'deepspeed' or 'fsdp2', got {self.engine!r}")
        if self.engine == "fsdp2" and self.stage != 3:
            problems.append("FSDP2 is stage 3")
        if self.global_batch % (self.world_size * self.micro_batch):
            problems.append(f"global batch {self.global_batch} is not a multiple of world_size x micro_batch "
                            f"({self.world_size} x {self.micro_batch})")
        if self.ckpt_impl not in ("memopt", "hf"):
            problems.append(f"ckpt_impl must be 'memopt' or 'hf', got {self.ckpt_impl!r}")
        if self.role not in ROLES:
            problems.append(f"role must be one of {list(ROLES)}, got {self.role!r}")
        if self.fsdp_optimizer not in ("fused", "foreach"):
            problems.append(f"fsdp_optimizer must be 'fused' or 'foreach', got {self.fsdp_optimizer!r}")
        if problems:
            raise ValueError(f"invalid case {self.id!r}: " + "; ".join(problems))
        self.setting()  # ShardingSetting's own checks

    @property
    def grad_accum(self) -> int:
        return self.global_batch // (self.world_size * self.micro_batch)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def setting(self) -> Any:
        from memopt.techniques.sharding import ShardingSetting

        return ShardingSetting(engine=self.engine, stage=self.stage, world_size=self.world_size,  # type: ignore[arg-type]
                               offload_optimizer=self.offload_optimizer,  # type: ignore[arg-type]
                               offload_params=self.offload_params,  # type: ignore[arg-type]
                               nvme_path=self.nvme_path, bucket_bytes=None)

    def strategy(self) -> Strategy:
        """The single-GPU strategy whose profile gives this case's activations (per rank)."""
        return Strategy(precision=ENGINE_PRECISION, checkpointing=self.checkpointing,
                        micro_batch_size=self.micro_batch, grad_accum_steps=self.grad_accum,
                        expandable_segments=self.expandable_segments)

    def replace(self, **changes: Any) -> ShardedCase:
        return dataclasses.replace(self, **changes)

    def label(self) -> str:
        return (f"{self.setting().label()} ac={self.checkpointing.label()} ({self.ckpt_impl}) "
                f"mb={self.micro_batch}x{self.grad_accum} cap={self.cap_bytes / GiB:g}GiB")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["checkpointing"] = dataclasses.asdict(self.checkpointing)
        d["micro_batch_candidates"] = list(self.micro_batch_candidates)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShardedCase:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown case keys {unknown}; valid keys: {sorted(known)}")
        d = dict(data)
        if isinstance(d.get("checkpointing"), dict):
            d["checkpointing"] = Checkpointing(**d["checkpointing"])
        d["micro_batch_candidates"] = tuple(d.get("micro_batch_candidates", ()))
        return cls(**d)


# -- predictions (memopt.distributed.estimate, for a case) ----------------------------------------------------
@functools.lru_cache(maxsize=4)
def _profile(model: str, batch: int, seq_len: int, hardware: str) -> Any:
    import memopt

    return memopt.profile(model, sample={"batch_size": batch, "seq_len": seq_len}, hardware=hardware)


def activation_timeline(model: str, strategy: Strategy, *, seq_len: int, hardware: str = "h200",
                        grads: str = "transient", profile: Any = None) -> list[TimelinePoint]:
    """``memopt.distributed.timeline.activation_timeline`` of a shipped model at ``strategy``'s micro-batch."""
    prof = profile if profile is not None else _profile(model, strategy.micro_batch_size, seq_len, hardware)
    return timeline.activation_timeline(prof, strategy, grads=grads)


def engine_run(case: ShardedCase) -> EngineRun:
    """The engine run of ``case``: memopt's buckets, or DeepSpeed's defaults for a baseline that keeps them."""
    return EngineRun.of(case.setting(), case.grad_accum, deepspeed_defaults=case.ds_defaults)


def engine_bytes_at(case: ShardedCase, facts: ModelFacts, point: TimelinePoint | None) -> dict[str, int]:
    """``memopt.distributed.engine_bytes.engine_bytes_at`` for ``case``."""
    return engine_bytes.engine_bytes_at(engine_run(case), facts, point)


def predict_case(case: ShardedCase, *, with_time: bool = True, profile: Any = None) -> dict[str, Any]:
    """memopt's prediction for ``case`` (per GPU): allocated and reserved peaks, where, their parts, host RAM,
    bytes outside the allocator and (``with_time``) the step time."""
    from memopt.hardware import load_hardware

    strategy = case.strategy()
    prof = profile if profile is not None else _profile(case.model, case.micro_batch, case.seq_len, case.hardware)
    out = est.predict_sharded(prof, strategy, engine_run(case), model_facts(case.model))
    hw = load_hardware(case.hardware)
    out["predicted_runtime_bytes"] = hw.runtime_overhead_bytes + out.pop("predicted_nccl_bytes")
    out["predicted_fits_cap"] = out["predicted_peak_reserved_bytes"] <= case.cap_bytes
    if with_time:
        out["predicted_step_s"] = predict_step_time(case)
    return out


def predict_step_time(case: ShardedCase, facts: ModelFacts | None = None) -> float:
    """Step time: memopt's single-GPU compute per micro-batch (forward, backward with recomputation), with the
    sharded engine's collectives, host copies, CPU optimizer and fixed work per micro-batch
    (``memopt.distributed.timing``)."""
    return float(predict_step_breakdown(case, facts).step_s)


def predict_step_breakdown(case: ShardedCase, facts: ModelFacts | None = None) -> Any:
    """``predict_step_time``'s ``memopt.distributed.timing.ShardedTime`` (the step and its terms)."""
    from memopt.hardware import load_hardware

    prof = _profile(case.model, case.micro_batch, case.seq_len, case.hardware)
    return est.sharded_time(prof, case.strategy(), engine_run(case), facts or model_facts(case.model),
                            load_hardware(case.hardware))


# -- memopt's choice of checkpointing and micro-batch ----------------------------------------------------
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def choose_memopt_setting(case: ShardedCase, *, block_options: Sequence[int | None] | None = None,
                          headroom: float = PLAN_HEADROOM, max_timed: int | None = None
                          ) -> tuple[ShardedCase, dict[str, Any]]:
    """The fastest predicted (checkpointing, micro-batch) of ``case``'s engine setting that fits its cap.

    Candidates: every micro-batch dividing the per-rank batch; no checkpointing, or full checkpointing of
    ``block_options`` blocks (default: all, 3/4, 1/2, 1/4 of them). Memory (cheap) is predicted for all;
    the fitting candidates are timed (``max_timed``: only that many, those with the fewest recomputed blocks per
    micro-batch first). All by default: the engines' fixed costs per micro-batch can make fewer, larger
    micro-batches with more recomputation the faster choice (FSDP2 on two H200s: full checkpointing at 4 x 1 ran
    0.564 s/step, no checkpointing at 2 x 2 0.584 s), which a cut at the least recomputation never times.
    Raises ``ValueError`` (with the smallest predicted peak) when nothing fits.
    """
    facts = model_facts(case.model)
    n_blocks = len(facts.unit_params)
    if block_options is None:
        block_options = sorted({n_blocks, (3 * n_blocks) // 4, n_blocks // 2, n_blocks // 4, 0}, reverse=True)
    per_rank = case.global_batch // case.world_size
    fitting: list[tuple[ShardedCase, dict[str, Any]]] = []
    smallest: tuple[int, str] | None = None
    for mb in sorted(_divisors(per_rank), reverse=True):
        for nb in block_options:
            ck = Checkpointing(mode="none") if nb == 0 else Checkpointing(
                mode="full", num_blocks=None if nb == n_blocks else nb)
            cand = case.replace(micro_batch=mb, checkpointing=ck, ckpt_impl="memopt")
            pred = predict_case(cand, with_time=False)
            peak = pred["predicted_peak_reserved_bytes"]
            if smallest is None or peak < smallest[0]:
                smallest = (peak, cand.label())
            if peak <= headroom * case.cap_bytes:
                fitting.append((cand, pred))
    if not fitting:
        raise ValueError(f"case {case.id!r}: no micro-batch / checkpointing fits {headroom:.0%} of the "
                         f"{case.cap_bytes / GiB:g} GiB cap; the smallest predicted peak is "
                         f"{(smallest or (0, ''))[0] / GiB:.2f} GiB ({(smallest or (0, ''))[1]})")

    def recompute(c: ShardedCase) -> tuple[float, int]:
        nb = len(c.checkpointing.blocks(n_blocks))
        return (nb / n_blocks, -c.micro_batch)

    fitting.sort(key=lambda cp: recompute(cp[0]))
    timed = []
    for cand, pred in fitting[:max_timed] if max_timed is not None else fitting:
        pred["predicted_step_s"] = predict_step_time(cand, facts)
        timed.append((pred["predicted_step_s"], cand, pred))
    timed.sort(key=lambda t: t[0])
    _, cand, pred = timed[0]
    pred["considered"] = len(fitting)
    return cand, pred


# -- the cases ------------------------------------------------------------------------------------------
def single_gpu_cases(model: str = "llama32_3b", *, cap_bytes: int = 16 * GiB, global_batch: int = 8,
                     seq_len: int = 2048, steps: int = 3) -> list[ShardedCase]:
    """The one-H200 cases of issue 5 (world size 1): memopt's three offload settings and the two baselines.

    memopt's cases carry full checkpointing at micro-batch 1 as a placeholder: the script replaces them by
    ``choose_memopt_setting`` before running. Baselines: DeepSpeed ZeRO-3 + offload_optimizer + offload_param
    (pinned), bf16, DeepSpeed's default buckets, Hugging Face gradient checkpointing, the largest micro-batch
    that fits (tried largest first); FSDP2 ``fully_shard`` per block and root with
    ``MixedPrecisionPolicy(bf16, fp32)`` and ``CPUOffloadPolicy``, HF checkpointing, likewise.
    """
    common: dict[str, Any] = {"model": model, "cap_bytes": cap_bytes, "global_batch": global_batch,
                              "seq_len": seq_len, "steps": steps, "world_size": 1}
    mbs = tuple(sorted(_divisors(global_batch), reverse=True))
    hf_full = Checkpointing(mode="full")
    return [
        ShardedCase(id="memopt_zero2_offload_opt", engine="deepspeed", stage=2, offload_optimizer="cpu",
                    compare_to="baseline_zero3_offload", **common),
        ShardedCase(id="memopt_zero3_offload_all", engine="deepspeed", stage=3, offload_optimizer="cpu",
                    offload_params="cpu", compare_to="baseline_zero3_offload", **common),
        ShardedCase(id="memopt_fsdp2_offload", engine="fsdp2", stage=3, offload_optimizer="cpu",
                    offload_params="cpu", compare_to="baseline_fsdp2_offload", **common),
        ShardedCase(id="baseline_zero3_offload", engine="deepspeed", stage=3, offload_optimizer="cpu",
                    offload_params="cpu", role="baseline", ds_defaults=True, ckpt_impl="hf", checkpointing=hf_full,
                    expandable_segments=False, micro_batch=mbs[0], micro_batch_candidates=mbs, **common),
        ShardedCase(id="baseline_fsdp2_offload", engine="fsdp2", stage=3, offload_optimizer="cpu",
                    offload_params="cpu", role="baseline", ckpt_impl="hf", checkpointing=hf_full,
                    expandable_segments=False, micro_batch=mbs[0], micro_batch_candidates=mbs, **common),
    ]


def two_gpu_cases(model: str = "llama32_3b", *, cap_bytes: int = 48 * GiB, global_batch: int = 8,
                  seq_len: int = 2048, steps: int = 3) -> list[ShardedCase]:
    """Two H200s (``torchrun --nproc-per-node 2``): FSDP2 full shard and ZeRO-3 without offload, per-GPU cap,
    and the hand-written baselines of issue 5 at the same cap and global batch.

    llama32_3b's states are 16 B/param = 51 GB, 25.7 GB per GPU over two: a 48 GiB cap leaves room for
    activations and the gathered units; memopt chooses checkpointing and micro-batch as on one GPU. Baselines:
    FSDP2 ``fully_shard`` per block and root with ``MixedPrecisionPolicy(bf16, fp32)`` (the states fit, so no
    ``CPUOffloadPolicy``), and DeepSpeed ZeRO-3 with ``offload_optimizer`` and ``offload_param`` to pinned CPU
    memory and its default buckets; both with Hugging Face checkpointing and the largest micro-batch that fits.
    """
    common: dict[str, Any] = {"model": model, "cap_bytes": cap_bytes, "global_batch": global_batch,
                              "seq_len": seq_len, "steps": steps, "world_size": 2}
    mbs = tuple(sorted(_divisors(global_batch // 2), reverse=True))  # per rank
    hf_full = Checkpointing(mode="full")
    return [
        ShardedCase(id="memopt_fsdp2_x2", engine="fsdp2", stage=3, compare_to="baseline_fsdp2_x2", **common),
        ShardedCase(id="memopt_zero3_x2", engine="deepspeed", stage=3, compare_to="baseline_zero3_offload_x2",
                    **common),
        ShardedCase(id="baseline_fsdp2_x2", engine="fsdp2", stage=3, role="baseline", ckpt_impl="hf",
                    checkpointing=hf_full, expandable_segments=False, micro_batch=mbs[0], micro_batch_candidates=mbs,
                    **common),
        ShardedCase(id="baseline_zero3_offload_x2", engine="deepspeed", stage=3, offload_optimizer="cpu",
                    offload_params="cpu", role="baseline", ds_defaults=True, ckpt_impl="hf", checkpointing=hf_full,
                    expandable_segments=False, micro_batch=mbs[0], micro_batch_candidates=mbs, **common),
    ]


def diagnostic_fsdp2_cases(model: str = "llama32_3b", *, world_size: int = 2, cap_bytes: int = 100 * GiB,
                           per_rank_batch: int = 4, seq_len: int = 2048, steps: int = 3) -> list[ShardedCase]:
    """Fixed FSDP2 configurations under a cap they stay well below, so that each stream's allocator pool grows to
    its natural peak (no retries): the reserved model's test. FSDP2 keeps its all-gather and reduce-scatter
    streams on one GPU too, so ``world_size=1`` tests the same pools. ``diag_fsdp2_full_default_alloc`` is the
    hand-written baseline's configuration with memopt's checkpointing: with ``diag_fsdp2_full`` it separates the
    effect of the checkpointing implementation from that of expandable segments on speed."""
    common: dict[str, Any] = {"model": model, "cap_bytes": cap_bytes, "global_batch": per_rank_batch * world_size,
                              "seq_len": seq_len, "steps": steps, "world_size": world_size, "engine": "fsdp2",
                              "stage": 3, "role": "diag"}
    full, none = Checkpointing(mode="full"), Checkpointing(mode="none")
    half = Checkpointing(mode="full", num_blocks=len(model_facts(model).unit_params) // 2)
    tag = f"x{world_size}"
    return [
        ShardedCase(id=f"diag_fsdp2_{tag}_full", micro_batch=per_rank_batch, checkpointing=full, **common),
        ShardedCase(id=f"diag_fsdp2_{tag}_full_default_alloc", micro_batch=per_rank_batch, checkpointing=full,
                    expandable_segments=False, **common),
        ShardedCase(id=f"diag_fsdp2_{tag}_half", micro_batch=per_rank_batch, checkpointing=half, **common),
        ShardedCase(id=f"diag_fsdp2_{tag}_none_2x", micro_batch=per_rank_batch // 2, checkpointing=none, **common),
    ]


# -- DeepSpeed config of a case -------------------------------------------------------------------------
def case_deepspeed_config(case: ShardedCase) -> dict[str, Any]:
    """The DeepSpeed config dict the GPU run passes to ``deepspeed.initialize``.

    memopt's cases: ``memopt.distributed.deepspeed_engine.deepspeed_config`` (the config ``memopt.wrap`` and
    ``export_deepspeed_json`` produce). Baselines: only what a user writes — the stage, bf16, the offload
    devices with ``pin_memory``, batch sizes and AdamW; buckets, prefetch and overlap stay DeepSpeed's.
    """
    if case.engine != "deepspeed":
        raise ValueError(f"case {case.id!r} runs FSDP2, not DeepSpeed")
    optimizer = {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0}}
    if not case.ds_defaults:
        from memopt.distributed.deepspeed_engine import deepspeed_config

        cfg = deepspeed_config(case.setting(), precision="bf16_autocast", micro_batch=case.micro_batch,
                               grad_accum=case.grad_accum, optimizer=optimizer,
                               largest_param=model_facts(case.model).largest_param)
        return cfg
    if "nvme" in (case.offload_optimizer, case.offload_params):
        raise ValueError(f"case {case.id!r}: a baseline with DeepSpeed's defaults offloads to the CPU only")
    zero: dict[str, Any] = {"stage": case.stage}
    if case.offload_optimizer == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if case.offload_params == "cpu":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {"train_micro_batch_size_per_gpu": case.micro_batch, "gradient_accumulation_steps": case.grad_accum,
            "train_batch_size": case.global_batch, "bf16": {"enabled": True}, "zero_optimization": zero,
            "optimizer": optimizer, "steps_per_print": 10**9, "wall_clock_breakdown": False}


# -- the report -----------------------------------------------------------------------------------------
def _rel(measured: float | None, predicted: float | None) -> float | None:
    if not measured or predicted is None:
        return None
    return (predicted - measured) / measured


def report_rows(rows: Sequence[dict[str, Any]], *, median_target: float = 0.03, max_target: float = 0.06
                ) -> dict[str, Any]:
    """Predicted vs measured per case (rank 0 and every rank), relative errors, OOMs, speed against baselines.

    A row is what ``measure_sharded.run_case`` writes (one per case and rank; for a baseline, the
    micro-batch that fitted). Errors are ``(predicted - measured) / measured`` of the peak allocated and
    reserved bytes; the summary takes rows that ran (``ok``) and fitted.
    """
    table: list[dict[str, Any]] = []
    for r in rows:
        case = r.get("case", {})
        entry = {"id": case.get("id", r.get("id", "?")), "rank": r.get("rank", 0), "role": case.get("role"),
                 "label": r.get("label", ""), "ok": bool(r.get("ok")), "oom": bool(r.get("oom")),
                 "fits_under_cap": r.get("fits_under_cap"), "cap_bytes": case.get("cap_bytes"),
                 "micro_batch": case.get("micro_batch"), "grad_accum": r.get("grad_accum"),
                 "predicted_peak_allocated_bytes": r.get("predicted_peak_allocated_bytes"),
                 "measured_peak_allocated_bytes": r.get("measured_peak_allocated_bytes"),
                 "predicted_peak_reserved_bytes": r.get("predicted_peak_reserved_bytes"),
                 "measured_peak_reserved_bytes": r.get("measured_peak_reserved_bytes"),
                 "measured_step_s": r.get("measured_step_s"), "predicted_step_s": r.get("predicted_step_s"),
                 "tokens_per_s": r.get("tokens_per_s"), "host_rss_peak_bytes": r.get("host_rss_peak_bytes"),
                 "predicted_host_bytes_per_rank": r.get("predicted_host_bytes_per_rank"),
                 "compare_to": case.get("compare_to") or None, "error": r.get("error")}
        entry["err_allocated"] = _rel(entry["measured_peak_allocated_bytes"], entry["predicted_peak_allocated_bytes"])
        entry["err_reserved"] = _rel(entry["measured_peak_reserved_bytes"], entry["predicted_peak_reserved_bytes"])
        table.append(entry)
    good = [e for e in table if e["ok"] and e["fits_under_cap"] and e["err_allocated"] is not None]
    ooms = [e["id"] for e in table if e["oom"] and e["role"] == "memopt"]

    def stats(key: str) -> dict[str, float | None]:
        vals = [abs(e[key]) for e in good if e[key] is not None]
        return {"median": statistics.median(vals) if vals else None, "max": max(vals) if vals else None,
                "n": len(vals)}

    speed = []
    by_id = {e["id"]: e for e in table if e["rank"] == 0}
    for e in table:
        base = by_id.get(e["compare_to"] or "")
        if e["rank"] == 0 and base and e.get("measured_step_s") and base.get("measured_step_s") and base["ok"] \
                and base["fits_under_cap"]:
            speed.append({"id": e["id"], "baseline": base["id"],
                          "speedup": base["measured_step_s"] / e["measured_step_s"]})
    alloc, res = stats("err_allocated"), stats("err_reserved")

    def within(s: dict[str, Any]) -> bool | None:
        if s["median"] is None:
            return None
        return bool(s["median"] <= median_target and s["max"] <= max_target)

    summary = {"allocated": alloc, "reserved": res, "targets": {"median": median_target, "max": max_target},
               "allocated_within_targets": within(alloc), "reserved_within_targets": within(res),
               "memopt_ooms_under_cap": ooms, "speed": speed,
               "speed_target_met": all(s["speedup"] >= 1.0 for s in speed) if speed else None}
    return {"rows": table, "summary": summary}


def _gib(v: Any) -> str:
    return "" if v is None else f"{v / GiB:.2f}"


def _pct(v: Any) -> str:
    return "" if v is None else f"{100 * v:+.1f}%"


def report_markdown(report: dict[str, Any], title: str = "Sharding and offload on the H200") -> str:
    """The report as Markdown tables (GiB = 2^30 bytes)."""
    lines = [f"# {title}", "", "Per GPU; errors are (predicted - measured) / measured. GiB = 2^30 bytes.", "",
             "| case | rank | setting | fits cap | pred alloc | meas alloc | err | pred res | meas res | err | "
             "step s | tokens/s | host RSS GiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for e in report["rows"]:
        fits = "error" if not e["ok"] else ("OOM" if e["oom"] or e["fits_under_cap"] is False else "yes")
        step = "" if e["measured_step_s"] is None else f"{e['measured_step_s']:.2f}"
        tps = "" if e["tokens_per_s"] is None else f"{e['tokens_per_s']:.0f}"
        lines.append(f"| {e['id']} | {e['rank']} | {e['label']} | {fits} | "
                     f"{_gib(e['predicted_peak_allocated_bytes'])} | {_gib(e['measured_peak_allocated_bytes'])} | "
                     f"{_pct(e['err_allocated'])} | {_gib(e['predicted_peak_reserved_bytes'])} | "
                     f"{_gib(e['measured_peak_reserved_bytes'])} | {_pct(e['err_reserved'])} | {step} | {tps} | "
                     f"{_gib(e['host_rss_peak_bytes'])} |")
    s = report["summary"]
    lines += ["", "## Summary", ""]
    for key in ("allocated", "reserved"):
        st = s[key]
        verdict = {True: "met", False: "not met", None: "no data"}[s[f"{key}_within_targets"]]
        lines.append(f"- peak {key}: median |error| {_pct(st['median'])}, max {_pct(st['max'])} over {st['n']} rows "
                     f"(targets {100 * s['targets']['median']:.0f}% / {100 * s['targets']['max']:.0f}%): {verdict}")
    lines.append(f"- memopt cases out of memory under the cap: {s['memopt_ooms_under_cap'] or 'none'}")
    for sp in s["speed"]:
        lines.append(f"- speed: {sp['id']} vs {sp['baseline']}: {sp['speedup']:.2f}x")
    errors = [e for e in report["rows"] if not e["ok"]]
    if errors:
        lines += ["", "## Errors", ""]
        lines += [f"- {e['id']} (rank {e['rank']}): {str(e['error'])[:300]}" for e in errors]
    return "\n".join(lines) + "\n"


