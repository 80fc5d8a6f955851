"""The sharded estimate's reserved bytes per allocator pool, against H200 runs that recorded each stream's pool.

``benchmarks/sharding/raw/session6_x1``: FSDP2 on one H200 (Llama-3.2-3B, 4 x 2048 per step, a 100 GiB cap it stays
well below, no allocator retries), ``torch.cuda.memory._snapshot`` segments grouped by stream after the steps.
The current estimator recomputes each prediction here, so the accuracy cannot regress silently."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memopt.validation import sharded_cases as sc

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
    if case.expandable_segments:
        assert abs(err) <= 0.04  # measured -1.6% .. -3.2%: the default pool's fragmentation is not modelled
    # the side pool (the reduce-scatter stream's: the fp32 gradients) exactly, to the 20 MiB segment
    facts = sc.model_facts(case.model)
    from memopt.distributed import estimate as est

    side = [p for p in row["reserved_by_stream"] if p["stream"] != "default"]
    assert len(side) == 1  # one GPU: no all-gather pool
    grads = 4 * facts.num_params + est.side_pool_growth(sc.engine_run(case), facts).get("reduce_scatter", 0)
    tol = 2 * est.LARGE_SEGMENT if case.expandable_segments else 0.01 * grads  # the default allocator: 29 segments
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
    assert abs(pred["predicted_peak_reserved_bytes"] - res) / res <= 0.08  # measured -7.3%: DeepSpeed's pools, roughly
    pools = {p["stream"]: p["reserved_bytes"] for p in row["reserved_by_stream"]}
    assert len(pools) == 3  # default, all-gather, reduce
