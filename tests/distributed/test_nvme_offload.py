"""NVMe offload (DeepSpeed ZeRO-Infinity) proven on the CPU, and its checks before training.

The slow test trains ZeRO-3 with ``offload_param`` and ``offload_optimizer`` on NVMe (``nvme_path`` a temporary
directory) in one process with DeepSpeed's CPU accelerator: its async I/O op (libaio) really writes and reads the swap
files. It is held against the same run with CPU offload (optimizer states on NVMe: identical losses, since swapping
them is a byte-exact round trip; parameters too: within the bf16 rounding DeepSpeed stores them with), memopt's
planned NVMe bytes (``sharded_memory(...).nvme_bytes``, the difference explained term by term) and the bytes the
engine moved through its async I/O handles.
"""

from __future__ import annotations

import ctypes.util
import os
import shutil
from pathlib import Path

import pytest

from memopt.distributed.deepspeed_engine import deepspeed_config, param_swap_buffer_elements
from memopt.distributed.engine_buffers import DS_PARAM_SWAP_BUFFER_SIZE
from memopt.distributed.host_tier import nvme_swap_bytes
from memopt.distributed.memory import sharded_memory
from memopt.distributed.model_states import state_bytes
from memopt.techniques.sharding import ShardingSetting
from tests.distributed.ds_ops import op_built

from . import _workers as w
from .test_deepspeed_cpu import _run

#: TinyLM(vocab, d, n): 1024 x 512 matrices are 2 MiB in fp32, over DeepSpeed's 1 MiB swap minimum
DIMS = (1024, 512, 2)
#: DeepSpeed's swap files are padded to 1 KiB (AIO_ALIGNED_BYTES); they hold parameters of at least 1 MiB
ALIGN_BYTES, MIN_SWAP_BYTES = 1024, 1024**2




def _aio_missing() -> str | None:
    """Why DeepSpeed's async I/O op cannot run here (None when it can)."""
    if not (shutil.which("c++") or shutil.which("g++")):
        return "no C++ compiler: DeepSpeed JIT-builds its async_io op"
    if ctypes.util.find_library("aio") is None:
        return "libaio is not installed (Debian: apt-get install libaio-dev)"
    dirs = [Path("/usr/include"), *(Path(d) for d in os.environ.get("CPATH", "").split(os.pathsep) if d)]
    if not any((d / "libaio.h").exists() for d in dirs):
        return "libaio.h is missing (Debian: apt-get install libaio-dev)"
    for op in ("async_io", "cpu_adam"):
        if not op_built(op):
            return (f"DeepSpeed's {op} op is not built here (scripts/prepare_test_env.sh builds it): "
                    "DS_ACCELERATOR=cpu python -c 'from deepspeed.ops.op_builder.cpu import AsyncIOBuilder, "
                    "CPUAdamBuilder; AsyncIOBuilder().load(); CPUAdamBuilder().load()'")
    return None


def _unwritable(path: str) -> bool:
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=path):
            return False
    except OSError:
        return Path(path).is_dir()


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


@pytest.mark.slow
@pytest.mark.distributed
def test_zero_infinity_trains_on_cpu_and_writes_the_planned_bytes(tmp_path):
    """ZeRO-3 with parameters and optimizer on NVMe, against CPU offload and memopt's plan (one rank, fp32 run).

    DeepSpeed 0.19.8 stores swapped parameters in the dtype its ``zero.Init`` chose: fp32 from an fp32 config
    (``zero_stage_3/float32params``, the same numbers as CPU offload), or its CPU accelerator's preferred bf16 on the
    path without a config (``bfloat16params``: bf16-rounded weights, the first loss ~1e-5 off CPU offload's). Both have
    been seen on CI machines with the same pins (not root-caused), so the test checks whichever was written.
    The optimizer side (fp32 master, Adam states, fp32 gradients)
    swaps without rounding: with only the optimizer on NVMe the losses are identical to CPU offload's.
    """
    pytest.importorskip("deepspeed")
    reason = _aio_missing()
    if reason:
        pytest.skip(reason)
    common = {"stage": 3, "pin_memory": False, "optimizer": "deepspeed", "dims": list(DIMS)}
    paths = {name: tmp_path / name for name in ("nvme", "opt_nvme")}
    for path in paths.values():
        path.mkdir()
    got = _run(tmp_path, [{"name": "nvme", "offload_optimizer": "nvme", "offload_params": "nvme",
                           "nvme_path": str(paths["nvme"]), **common},
                          {"name": "opt_nvme", "offload_optimizer": "nvme", "offload_params": "cpu",
                           "nvme_path": str(paths["opt_nvme"]), **common},
                          {"name": "cpu", "offload_optimizer": "cpu", "offload_params": "cpu", **common}])
    run, opt_only, cpu = got["nvme"], got["opt_nvme"], got["cpu"]
    assert run["inner"] == opt_only["inner"] == cpu["inner"] == "DeepSpeedCPUAdam"
    # equivalence: optimizer states on NVMe instead of host RAM give the same numbers, bit for bit
    assert opt_only["losses"] == cpu["losses"]
    assert opt_only["nvme_swap_bytes"]["optimizer"] > 0 and opt_only["nvme_swap_bytes"]["params"] == 0
    # parameters on NVMe too, in the swap dtype (bf16: rounded weights, measured 1.2e-5 on the first loss and 3.5e-3
    # by the third step; fp32: the same numbers as CPU offload)
    swap_dirs = sorted(d.name for d in (paths["nvme"] / "zero_stage_3").iterdir() if d.name.endswith("params"))
    assert swap_dirs in (["bfloat16params"], ["float32params"]), swap_dirs
    if swap_dirs == ["float32params"]:
        assert run["losses"] == cpu["losses"]
    assert run["losses"][0] == pytest.approx(cpu["losses"][0], rel=1e-4)
    assert run["losses"] == pytest.approx(cpu["losses"], rel=2e-2)

    # memopt's plan for this setting (one rank, fp32): parameters 4 B + optimizer side (master 0 + Adam 8) + the fp32
    # gradient (4) per param
    numels = run["param_numels"]
    p = sum(numels)
    plan = sharded_memory(p, engine="deepspeed", stage=3, world_size=1, sb=state_bytes("deepspeed", "fp32"),
                          offload_optimizer="nvme", offload_params="nvme")
    assert plan.nvme_bytes == 16 * p
    files = run["nvme_swap_bytes"]
    # DeepSpeed's layout: a file per parameter of >= 1 MiB in the swap dtype (smaller ones stay in memory); for the
    # optimizer's one sub-group the fp32 master, exp_avg and exp_avg_sq (4 B each per parameter) and, written at the
    # accumulation boundary, the fp32 gradient of each swapped tensor
    swap_elt = 2 if swap_dirs == ["bfloat16params"] else 4
    swapped = sum(n for n in numels if n * swap_elt >= MIN_SWAP_BYTES and n >= 100_000)
    assert swapped > 0 and files["params"] == swap_elt * swapped
    assert files["optimizer"] == 3 * _aligned(4 * p)
    assert files["other"] == 4 * swapped  # the gradient files
    # the difference from the plan, term by term: swap-dtype instead of fp32 parameters (none under 1 MiB), the fp32
    # master DeepSpeed keeps beside them, gradient files for the swapped tensors only
    assert files["total"] == plan.nvme_bytes - 4 * p + swap_elt * swapped + 4 * p - 4 * p + 4 * swapped

    # what the engine moved through its aio handles: each step writes every swap file once and reads the optimizer
    # side and gradients once and the parameters per micro-batch
    steps = run["aio_steps"]
    assert steps["write_bytes"] == 3 * files["total"]
    assert steps["read_bytes"] >= 3 * (files["optimizer"] + files["other"] + files["params"])


def test_param_swap_buffer_holds_the_largest_partition():
    s = ShardingSetting(engine="deepspeed", stage=3, world_size=1, offload_optimizer="nvme", offload_params="nvme",
                        nvme_path="/nvme")
    assert param_swap_buffer_elements(s) == DS_PARAM_SWAP_BUFFER_SIZE
    emb = 151936 * 896  # qwen25_0_5b's embedding: 136M elements, over DeepSpeed's 100M default
    cfg = deepspeed_config(s, largest_param=emb)
    assert cfg["zero_optimization"]["offload_param"]["buffer_size"] == emb
    two = ShardingSetting(**{**s.to_dict(), "world_size": 2})
    assert param_swap_buffer_elements(two, emb) == DS_PARAM_SWAP_BUFFER_SIZE  # 68M per rank


def test_nvme_swap_bytes_sorts_deepspeed_files(tmp_path):
    files = {"zero_stage_3/bfloat16params/rank0/3_param.tensor.swp": 2048,
             "zero_stage_3/optimizer/rank0/7.tensor.swp": 4096,
             "zero_stage_3/optimizer/rank0/7_gradient_0_10.tensor.swp": 1024,
             "zero_stage_3/optimizer/rank0/notes.txt": 99}
    for rel, size in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"\0" * size)
    assert nvme_swap_bytes(tmp_path) == {"params": 2048, "optimizer": 4096, "other": 1024, "total": 7168, "files": 3}


def test_build_deepspeed_checks_offload_before_initialize(tmp_path, monkeypatch):
    """A missing or read-only NVMe path and too little host RAM stop ``build_deepspeed`` before DeepSpeed starts."""
    deepspeed = pytest.importorskip("deepspeed")
    from memopt.distributed import host_tier
    from memopt.distributed.deepspeed_engine import build_deepspeed

    def no_initialize(**_: object) -> None:
        raise AssertionError("deepspeed.initialize ran: the offload check came too late")

    monkeypatch.setattr(deepspeed, "initialize", no_initialize)
    nvme = {"engine": "deepspeed", "stage": 3, "offload_optimizer": "nvme", "offload_params": "nvme"}
    with pytest.raises(ValueError, match="does not exist"):
        build_deepspeed(w.tiny_model(), ShardingSetting(**nvme, nvme_path=str(tmp_path / "nope")), "fp32")
    if _unwritable("/sys/kernel"):  # sysfs: no new files, root included
        with pytest.raises(ValueError, match="not writable"):
            build_deepspeed(w.tiny_model(), ShardingSetting(**nvme, nvme_path="/sys/kernel"), "fp32")
    real = os.sysconf
    monkeypatch.setattr(host_tier.os, "sysconf", lambda k: 1 if k == "SC_PHYS_PAGES" else real(k))
    cpu = ShardingSetting(engine="deepspeed", stage=3, offload_optimizer="cpu", offload_params="cpu")
    with pytest.raises(ValueError, match="host RAM"):
        build_deepspeed(w.tiny_model(), cpu, "fp32")
