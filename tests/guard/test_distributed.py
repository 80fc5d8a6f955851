"""Two gloo processes on the CPU: one rank's OOM makes both retry together (no hang, same result)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from ._dist_worker import SCENARIOS, worker
from ._helpers import batches
from .test_recovery import reference

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.timeout(240)
def test_one_rank_oom_retries_on_every_rank(tmp_path):
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    ctx = mp.start_processes(worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=False,
                             start_method="spawn")
    while not ctx.join(timeout=200):
        pass
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    data = batches(4)
    for name, (fail_rank, at, phase, _ops, _tx) in SCENARIOS.items():
        ref_params, ref_losses, ref_step = reference(at, data)
        for rank, res in enumerate(r[name] for r in results):
            assert res["fired"] == (1 if rank == fail_rank else 0)
            assert res["steps"] == res["steps_done"] == len(data)  # step count intact on every rank
            assert res["strategy"] == ref_step.strategy.label()  # the same re-plan everywhere
            assert res["losses"] == ref_losses
            for a, b in zip(res["params"], ref_params):
                assert torch.equal(a, b)
            [(f_phase, location, failed)] = res["failures"]
            assert failed == [fail_rank]
            if rank == fail_rank:
                assert f_phase.startswith(phase)
            elif phase == "forward":
                assert location == "peer"  # aborted at the agreement before its optimizer step
            else:
                assert location == "completed"  # its finished step was rolled back from the copy
