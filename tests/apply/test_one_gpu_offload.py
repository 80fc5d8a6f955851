"""memopt.wrap applies a one-GPU offload plan in the same plain process: it starts the one-process group the
engine needs (it refused: "... apply it with memopt.wrap(model, plan='plan.json') in a torch.distributed
process"), and training follows the single-device trajectory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "distributed"))
import _workers as w  # noqa: E402

from tests.distributed.ds_ops import op_built  # noqa: E402


def _run(tmp_path, engine: str, mode: str, loss: str = "model") -> dict:
    out = tmp_path / f"{engine}_{mode}_{loss}.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", PYTHONPATH=str(HERE.parents[1]))
    proc = subprocess.run([sys.executable, str(HERE / "_offload_worker.py"), str(out), engine, mode, loss],
                          env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("mode", ["budget", "plan"])
def test_fsdp2_offload_plan_applied_in_process(tmp_path, mode):
    got = _run(tmp_path, "fsdp2", mode)
    assert got["wrapped"] == "Wrapped" if mode == "budget" else got["wrapped"] == "ShardedWrapped"
    assert got["group"] == 1 and got["started_group"] is True  # memopt started it; the user did nothing
    assert got["group_after_close"] is False  # and close() ends it
    assert got["losses"] == pytest.approx(w.reference_losses(3), rel=1e-5)
    # the plan was traced without a KV cache; checkpointed blocks would keep one's keys and values alive
    assert got["use_cache_in_training"] is False
    # nor with the model's own gradient checkpointing: the plan decides which blocks recompute
    assert got["own_checkpointing_in_training"] is False




def test_a_summed_loss_through_the_in_process_offload_plan_is_measured_and_exact(tmp_path):
    """The offload engine's step splits the batch too: its summed loss is measured and accumulated unweighted (as a
    mean, the gradient was a quarter of the whole batch's: 4 micro-batches of 2)."""
    got = _run(tmp_path, "fsdp2", "budget", "summed")
    assert got["wrapped"] == "Wrapped" and got["reduction"] == "sum"
    assert got["losses"] == pytest.approx(w.summed_reference(3), rel=1e-5)


def test_the_offload_step_starts_from_no_gradient(tmp_path):
    """Gradients another loss left on the parameters before a step are not the batch's: the sharded step starts
    from none, as the one-GPU step does (they were added to the batch's before)."""
    got = _run(tmp_path, "fsdp2", "budget", "stale")
    assert got["losses"] == pytest.approx(w.reference_losses(3), rel=1e-5)


@pytest.mark.slow
def test_deepspeed_offload_plan_applied_in_process(tmp_path):
    pytest.importorskip("deepspeed")
    if not op_built("cpu_adam"):
        pytest.skip("DeepSpeed's cpu_adam extension is not built here (scripts/prepare_test_env.sh builds it)")
    got = _run(tmp_path, "deepspeed", "budget")
    assert got["engine"] == "DeepSpeedEngine" and got["group"] == 1 and got["started_group"] is True
    ref = w.reference_losses(3)
    assert got["losses"][0] == pytest.approx(ref[0], rel=1e-5)
    assert got["losses"] == pytest.approx(ref, rel=1e-3)  # CPUAdam's own arithmetic


@pytest.mark.slow
def test_deepspeed_engine_runs_on_the_group_memopt_started(tmp_path):
    """DeepSpeed (ZeRO-2 without offload: no CPUAdam build needed) initializes over the one-process group memopt
    started, in a process no launcher set up."""
    pytest.importorskip("deepspeed")
    got = _run(tmp_path, "deepspeed_zero2", "budget")
    assert got["engine"] == "DeepSpeedEngine" and got["group"] == 1 and got["started_group"] is True
    ref = w.reference_losses(3)
    assert got["losses"][0] == pytest.approx(ref[0], rel=1e-5)
    assert got["losses"] == pytest.approx(ref, rel=1e-3)  # DeepSpeed's flat fp32 partitions and its AdamW


@pytest.mark.slow
def test_a_summed_loss_through_the_deepspeed_engine_is_measured_and_exact(tmp_path):
    """The same through DeepSpeed's engine (ZeRO-2, no CPUAdam build needed), whose own precision the check keeps."""
    pytest.importorskip("deepspeed")
    got = _run(tmp_path, "deepspeed_zero2", "budget", "summed")
    assert got["engine"] == "DeepSpeedEngine" and got["reduction"] == "sum"
    ref = w.summed_reference(3)
    assert got["losses"][0] == pytest.approx(ref[0], rel=1e-5)
    assert got["losses"] == pytest.approx(ref, rel=1e-3)  # DeepSpeed's flat fp32 partitions and its AdamW
