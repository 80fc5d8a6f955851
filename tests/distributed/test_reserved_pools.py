"""The sharded estimate's reserved bytes per allocator pool, against H200 runs that recorded each stream's pool.

``benchmarks/sharding/raw/session6_x1``: FSDP2 on one H200 (Llama-3.2-3B, 4 x 2048 per step, a 100 GiB cap it stays
well below, no allocator retries), ``torch.cuda.memory._snapshot`` segments grouped by stream after the steps.
The current estimator recomputes each prediction here, so the accuracy cannot regress silently."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import sharded_cases as sc

RUNS = sorted((Path(__file__).resolve().parents[2] / "benchmarks" / "sharding" / "raw" / "session6_x1").glob(
    "*.rank0.json"))


@pytest.mark.slow
@pytest.mark.parametrize("path", RUNS, ids=[p.name.split(".")[0] for p in RUNS])
def test_reserved_against_h200_pools(path: Path) -> None:
    row = json.loads(path.read_text())
    assert row["ok"] and row["num_alloc_retries"] == 0
    case = sc.ShardedCase.from_dict(row["case"])
    pred = sc.predict_case(case, with_time=False)
    err = (pred["predicted_peak_reserved_bytes"] - row["measured_peak_reserved_bytes"]) / row[
        "measured_peak_reserved_bytes"]
    alloc_err = (pred["predicted_peak_allocated_bytes"] - row["measured_peak_allocated_bytes"]) / row[
        "measured_peak_allocated_bytes"]
    assert abs(alloc_err) <= 0.01
    # measured -0.1% .. -0.5% with expandable segments, -1.6% with the default allocator (were -1.6% .. -4.6%
    # before the default pool's slack was modelled)
    assert abs(err) <= (0.01 if case.expandable_segments else 0.025)
    # NCCL's memory at world size 1 and the CUDA runtime: what the process holds outside the allocator
    assert abs(pred["predicted_runtime_bytes"] - row["measured_outside_allocator_bytes"]) <= 8 * 2**20
    # the side pool (the reduce-scatter stream's: the fp32 gradients) exactly, to the 20 MiB segment
    facts = sc.model_facts(case.model)
    from memopt.distributed.engine_bytes import side_pool_growth
    from memopt.distributed.estimate import LARGE_SEGMENT

    side = [p for p in row["reserved_by_stream"] if p["stream"] != "default"]
    assert len(side) == 1  # one GPU: no all-gather pool
    grads = 4 * facts.num_params + side_pool_growth(sc.engine_run(case), facts).get("reduce_scatter", 0)
    tol = 2 * LARGE_SEGMENT if case.expandable_segments else 0.01 * grads  # the default allocator: 29 segments
    assert abs(side[0]["reserved_bytes"] - grads) <= tol


NVME_ROW = Path(__file__).resolve().parents[2] / "benchmarks" / "sharding" / "raw" / "session6_nvme" / "nvme.json"


@pytest.mark.slow
def test_zero_infinity_row_on_the_h200() -> None:
    """ZeRO-3 with parameters and optimizer on NVMe (DeepSpeed's aio op against a carried libaio) on one H200: the
    bytes written to the NVMe directory, and the per-GPU peaks, against today's prediction."""
    data = json.loads(NVME_ROW.read_text())
    row = data["row"]
    assert row["ok"] and not row["oom"] and row["fits_under_cap"]
    case = sc.ShardedCase.from_dict(row["case"])
    pred = sc.predict_case(case, with_time=False)
    written = row["nvme_swap_bytes"]["total"]
    assert abs(pred["predicted_nvme_bytes_per_node"] - written) / written <= 0.01  # measured +0.4%
    alloc, res = row["measured_peak_allocated_bytes"], row["measured_peak_reserved_bytes"]
    assert abs(pred["predicted_peak_allocated_bytes"] - alloc) / alloc <= 0.05  # measured +4.1%
    assert abs(pred["predicted_peak_reserved_bytes"] - res) / res <= 0.02  # measured -0.4% (-7.3% before session 9)
    pools = {p["stream"]: p["reserved_bytes"] for p in row["reserved_by_stream"]}
    assert len(pools) == 3  # default, all-gather, reduce
    # the reduce stream's pool: the largest gradient partition copied to the GPU and its float64 norm chunk
    from memopt.distributed.engine_bytes import side_pool_growth
    from memopt.distributed.estimate import LARGE_SEGMENT

    reduce = side_pool_growth(sc.engine_run(case), sc.model_facts(case.model))["reduce"]
    assert abs(max(v for k, v in pools.items() if k != "default") - reduce) <= 2 * LARGE_SEGMENT
    # the step time with the disk's measured bandwidth (configs/hardware/h200.yaml: dd with O_DIRECT, queue depth 1,
    # 1.5 / 1.3 GB/s): 16.0 s predicted for 13.3 s measured (5.5 s with the 6 / 4 GB/s defaults). The run implies
    # ~1.8 GB/s (DeepSpeed's aio queues 8 requests): the prediction errs slow, which keeps NVMe the last resort
    timed = sc.predict_case(case, with_time=True)["predicted_step_s"]
    assert 1.0 <= timed / row["measured_step_s"] <= 1.3


S9 = Path(__file__).resolve().parents[2] / "benchmarks" / "sharding" / "raw" / "session9"


@pytest.mark.slow
@pytest.mark.parametrize("name,plan_file", [("z3_3b", "s9_llama32_3b_16GiB_zero3_offload.json"),
                                            ("z3_1b", "s9_llama32_1b_12GiB_zero3_offload.json"),
                                            ("q15", "s9_qwen2_1_5b_12GiB.json")])
def test_zero3_offload_pools_from_the_allocator_history(name: str, plan_file: str) -> None:
    """DeepSpeed ZeRO-3 with optimizer and parameters on the CPU, applied by ``memopt.wrap`` on one H200 with the
    allocator's history recorded: each side stream's pool at its own peak against today's prediction of it, their
    sum with the default pool's against the uncapped reserved prediction (the runs themselves were capped), and the
    measured total inside the budget. The pool model was derived from the two Llama rows; Qwen2-1.5B (the planner's
    own plan at 12 GiB; a 233M-element embedding, under the 250M norm chunk) was run after it, unchanged."""
    from memopt.distributed import engine_bytes
    from memopt.distributed.estimate import LARGE_SEGMENT
    from memopt.hardware import load_hardware
    from memopt.plan import sharded as sh
    from memopt.plan.schema import Plan
    from memopt.profile.engine_facts import facts_of_profile
    from memopt.techniques.sharding import ShardingSetting

    row = json.loads((S9 / name / "rank0.json").read_text())
    plan = Plan.load(Path(__file__).resolve().parents[2] / "benchmarks" / "sharding" / "plans" / plan_file)
    assert row["plan"] == plan.strategy.label() and row["measured_total_bytes"] <= plan.budget_bytes
    prof = sc._profile(plan.model["name"], plan.strategy.micro_batch_size, int(plan.model["sample"]["seq_len"]),
                       plan.hardware)
    facts = facts_of_profile(prof)
    setting = ShardingSetting.from_any(plan.strategy.extra("sharding"))
    got = sh._predict(sh._SharedWork(prof, facts, load_hardware(plan.hardware)), plan.strategy, setting)
    assert abs(got.peak_allocated_bytes / row["measured_peak_allocated_bytes"] - 1) <= 0.015  # +0.8, +1.1, +1.3%
    peaks = {p["stream"]: p for p in row["stream_peaks"]}
    default = peaks.pop("default")
    run = engine_bytes.EngineRun.of(setting, plan.strategy.grad_accum_steps)
    growth = engine_bytes.side_pool_growth(run, facts)
    # the reduce pool's largest block is the float64 norm chunk of the largest gradient partition
    chunk = min(facts.largest_param, engine_bytes.DS_NORM_CHUNK) * 8
    reduce = next(p for p in peaks.values() if max(p["live_sizes"]) == chunk)
    gather = next(p for p in peaks.values() if p is not reduce)
    assert abs(reduce["mapped_peak_bytes"] - growth["reduce"]) <= 2 * LARGE_SEGMENT  # 2.79, 2.54, 2.35 GB
    # the all-gather pool: predicted at or above what it allocated (+1.2%, 0%, +8.4%: Qwen's overshoot of the
    # live bound was smaller than the prefetch bucket the prediction adds)
    want_gather = engine_bytes._zero3_gathered(run, facts) + growth["all_gather"]
    assert 0.98 <= want_gather / gather["peak_allocated_bytes"] <= 1.10
    pools = default["mapped_peak_bytes"] + gather["mapped_peak_bytes"] + reduce["mapped_peak_bytes"]
    assert abs(got.peak_reserved_bytes / pools - 1) <= 0.03  # -1.1%, -0.6%, -1.6%


X2_S5 = Path(__file__).resolve().parents[2] / "benchmarks" / "sharding" / "raw" / "session5_x2_call3"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["memopt_zero3_x2", "baseline_zero3_offload_x2"])
def test_two_gpu_zero3_rows_held_their_logits(name: str) -> None:
    """DeepSpeed ZeRO-3 over two H200s (session 5). That harness kept the model's output alive through DeepSpeed's
    backward; ``DistributedTrainStep`` now drops it first and the estimator follows it. Today's allocated
    prediction plus the held bf16 logits (micro-batch x sequence x vocabulary x 2 B) gives the measured peak."""
    row = json.loads((X2_S5 / f"{name}.mb4.rank0.json").read_text())
    case = sc.ShardedCase.from_dict(row["case"])
    pred = sc.predict_case(case, with_time=False)
    from memopt.models import build_model

    vocab = build_model(case.model, device="meta").config.vocab_size
    held = case.micro_batch * case.seq_len * vocab * 2
    alloc = row["measured_peak_allocated_bytes"]
    assert abs((pred["predicted_peak_allocated_bytes"] + held) / alloc - 1) <= 0.01  # +0.2%, -0.2%
    assert pred["predicted_peak_allocated_bytes"] < alloc  # without the held output: -4.5%, -11.0%
