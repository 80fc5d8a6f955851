"""GPU checks of the guard (skipped without CUDA): real allocator figures, a real OOM recovered, a snapshot."""

from __future__ import annotations

import json

import pytest
import torch

from memopt.guard.escalation import step_down
from memopt.guard.leaks import LeakDetector
from memopt.guard.memory import CudaMemorySource
from memopt.guard.reapply import PreparedReplanner
from memopt.guard.runtime import RuntimeGuard
from memopt.guard.telemetry import Telemetry
from memopt.step.prepare import prepare
from memopt.strategy import Strategy
from memopt.units import MiB

from ._helpers import TinyLM, fake_plan

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _cuda_batch(batch_size: int, seq_len: int, seed: int, vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
    return {"input_ids": ids.cuda(), "labels": ids.roll(-1, 1).cuda()}


def test_cuda_source_and_telemetry_fields():
    src = CudaMemorySource()
    torch.cuda.synchronize()
    src.reset_peak()
    before = src.sample()
    x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    after = src.sample()
    assert after.allocated_bytes - before.allocated_bytes == 64 * MiB
    assert after.peak_allocated_bytes >= after.allocated_bytes
    assert after.device_used_bytes and after.device_total_bytes and after.outside_allocator_bytes is not None
    assert src.tensor_bytes({"x": x}) == 64 * MiB
    del x
    tel = Telemetry(src, plan=fake_plan(Strategy()), leaks=False)
    tel.begin_step()
    y = torch.ones(1 << 20, device="cuda")
    rec = tel.end_step(loss=0.0)
    assert rec["peak_allocated_bytes"] >= 4 * MiB and rec["device_used_bytes"] > 0
    assert tel.progress().startswith("mem ")
    tel.close()
    del y


def test_leak_caught_on_gpu_within_5_steps():
    torch.manual_seed(0)
    vocab = 8192
    model = TinyLM(vocab=vocab, dim=512, layers=4, dropout=0.0).cuda()
    prepared = prepare(model, Strategy(micro_batch_size=8, grad_accum_steps=1, optimizer="adamw_fused"),
                       device_type="cuda")
    src = CudaMemorySource()
    det = LeakDetector(threshold_bytes=8 * MiB, warn=False)
    tel = Telemetry(src, leaks=det)
    tel.attach(prepared.step)
    kept = []
    with tel:
        for k in range(5):
            batch = _cuda_batch(8, 256, k, vocab)
            tel.begin_step(batch)
            loss = prepared.step.step(batch)
            kept.append(model(**_cuda_batch(8, 256, 100 + k, vocab))["loss"])  # eval without no_grad
            tel.end_step(loss=loss, batch=batch)
    assert det.report is not None and det.report.cause == "graph_not_backpropagated"


def test_real_oom_is_recovered_and_snapshotted(tmp_path):
    """Cap the allocator between what micro-batch 16 and micro-batch 2 need: the first step runs out of
    memory for real, the guard steps down and training goes on; a memory snapshot is dumped."""
    torch.manual_seed(0)
    vocab, seq = 32000, 256
    model = TinyLM(vocab=vocab, dim=256, layers=4, dropout=0.0).cuda()
    kwargs = {"device_type": "cuda"}

    def peak(mb: int) -> int:
        p = prepare(model, Strategy(micro_batch_size=mb, grad_accum_steps=16 // mb, optimizer="adamw_fused"),
                    **kwargs)
        p.step.step(_cuda_batch(16, seq, 0, vocab))
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        p.step.step(_cuda_batch(16, seq, 1, vocab))
        result = torch.cuda.max_memory_reserved()
        p.undo()
        del p
        torch.cuda.empty_cache()
        return result

    small, big = peak(2), peak(16)
    assert big > 2 * small
    total = torch.cuda.mem_get_info()[1]
    strategy = Strategy(micro_batch_size=16, grad_accum_steps=1, optimizer="adamw_fused")
    prepared = prepare(model, strategy, **kwargs)
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    torch.cuda.set_per_process_memory_fraction((small + big) / 2 / total)
    try:
        guard = RuntimeGuard(prepared.step, fake_plan(strategy, global_batch=16), run_dir=tmp_path,
                             replanner=PreparedReplanner(prepared, kwargs, step_down), calibrate=False)
        with guard:
            for k in range(4):
                guard.step(_cuda_batch(16, seq, 10 + k, vocab))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.memory._record_memory_history(enabled=None)
    failures = guard.oom.report.failures
    assert failures and "out of memory" in failures[0].message
    assert failures[0].requested_bytes and failures[0].needed_bytes
    assert guard.train_step.strategy.micro_batch_size < 16 and guard.train_step.steps_done == 4
    assert failures[0].snapshot_path and (tmp_path / "snapshots").is_dir()
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert "oom" in [e["kind"] for e in events]
