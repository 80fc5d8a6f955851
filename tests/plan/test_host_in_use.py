"""The host tier of an offload plan made for this machine's RAM leaves out what its processes already hold (the
user's model on the host, other jobs): a host that runs out kills the process, losing the run. The model's own host
copy counts as free, since the engine moves it off the host."""

from __future__ import annotations

import pytest
import torch

import memopt
from memopt.distributed import host_tier
from memopt.hardware import load_hardware
from memopt.plan import sharded
from memopt.plan.context import resolve_policy
from memopt.plan.planner import host_copy_bytes
from memopt.plan.sharded import plan_sharded
from memopt.techniques.sharding import ShardingSetting
from memopt.units import GiB

OFFLOAD = [ShardingSetting(engine="fsdp2", stage=3, world_size=1, offload_optimizer="cpu", offload_params="cpu")]


@pytest.fixture(scope="module")
def profile():
    return memopt.profile("tiny_llama", sample={"batch_size": 8, "seq_len": 64}, hardware="h200")


def _plan(profile, monkeypatch, *, total: int, taken: int):
    monkeypatch.delenv("MEMOPT_HOST_MEMORY", raising=False)
    monkeypatch.setattr(sharded, "machine_host_memory_bytes", lambda: total)
    monkeypatch.setattr(sharded, "machine_host_taken_bytes", lambda reclaimable=0: taken)
    return plan_sharded(profile, load_hardware("h200"), 8 * GiB, resolve_policy(None), world_size=1, nodes=1,
                        settings=OFFLOAD)


def test_what_the_machine_holds_is_not_offered_to_the_offloaded_states(profile, monkeypatch):
    free, _ = _plan(profile, monkeypatch, total=64 * GiB, taken=0)
    need = free.prediction["host_bytes_per_node"]
    assert free.fits and need > 0
    total = int(need / 0.9) + GiB  # 90% of it holds the states with a GiB to spare
    assert _plan(profile, monkeypatch, total=total, taken=0)[0].fits
    held, cands = _plan(profile, monkeypatch, total=total, taken=2 * GiB)  # other processes hold 2 GiB of it
    assert not held.fits and all("this machine's processes hold" in c.reason for c in cands)
    assert any("held by its processes now" in n for n in held.notes)


def test_taken_is_total_less_available_less_the_models_host_copy(monkeypatch, tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {32 * 2**20} kB\nMemAvailable: {20 * 2**20} kB\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(
        meminfo if path == "/proc/meminfo" else path, *a, **k))
    monkeypatch.setattr(host_tier, "machine_host_memory_bytes", lambda: 32 * GiB)
    monkeypatch.delenv("MEMOPT_HOST_MEMORY", raising=False)
    assert host_tier.machine_host_taken_bytes() == 12 * GiB
    assert host_tier.machine_host_taken_bytes(5 * GiB) == 7 * GiB  # the model's copy is freed by the engine
    assert host_tier.machine_host_taken_bytes(40 * GiB) == 0
    monkeypatch.setenv("MEMOPT_HOST_MEMORY", "32GiB")  # a stated RAM size: nothing measured
    assert host_tier.machine_host_taken_bytes() == 0


def test_the_model_host_copy_counts_each_storage_once():
    lin = torch.nn.Linear(64, 64)
    tied = torch.nn.Sequential(lin, torch.nn.Linear(64, 64))
    tied[1].weight = lin.weight
    assert host_copy_bytes(tied) == (64 * 64 + 64 + 64) * 4
    assert host_copy_bytes("tiny_llama") == 0
