"""The step-time clock's terms against hand-computed truths: kernel counts of a model of identical blocks, the host
floor (ops x dispatch_s), selective checkpointing's dispatch-mode ops, full checkpointing's hooked ops, the recompute
of checkpointed blocks, the gradient accumulation of micro-batches, the offload copies and the optimizer's host
floor."""

from dataclasses import replace

import pytest
import torch
from torch import nn

import memopt
from memopt.estimate.timing import DEFAULT_TIMING, library_time, step_time, terms_time
from memopt.strategy import Checkpointing, Strategy

D, TOKENS = 64, 16 * 8  # width, tokens of a micro-batch (16 samples x 8 positions)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D, bias=False)

    def forward(self, h):
        return torch.relu(self.fc(h))


class Stack(nn.Module):
    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.square().mean()


def _estimate(blocks: int, strategy: Strategy, timing=DEFAULT_TIMING):
    prof = memopt.profile(Stack(blocks), torch.randn(16, 8, D), hardware="h200", use_cache=False)
    return memopt.estimate(prof, strategy, exact_reserved=False, timing=timing)


def _launches(est) -> float:
    t = est.detail["time_terms"]
    return t["forward"]["launches"] + t["backward"]["launches"]


FP32 = Strategy(precision="fp32", micro_batch_size=16)


@pytest.fixture(scope="module")
def plain():
    return {n: _estimate(n, FP32) for n in (6, 8)}


def test_a_block_launches_its_kernels_and_nothing_else(plain):
    # per block: forward mm + relu; backward threshold_backward + mm (input grad) + mm (weight grad). Transposes and
    # views launch nothing, nor do the trace's metadata queries (prim::device), which once counted 3 of 4 ops
    assert _launches(plain[8]) - _launches(plain[6]) == 2 * (2 + 3)


def test_the_host_floor_is_ops_times_dispatch(plain):
    host_bound = replace(DEFAULT_TIMING, dispatch_s=1e-3, micro_batch_s=0.0, sac_dispatch_s=0.0, overlap_loss=0.0)
    for n, est in plain.items():
        slow = _estimate(n, FP32, timing=host_bound)
        # the tiny model's GPU time is microseconds: the pass is exactly its kernels at 1 ms each
        assert slow.detail["host_s"] == pytest.approx(_launches(est) * 1e-3, rel=1e-12)
        assert slow.detail["host_bound"] == 1.0
        assert slow.step_time_s == pytest.approx(slow.detail["host_s"] + slow.detail["optimizer_s"], rel=1e-12)
    # two more blocks: ten more kernels at 1 ms
    a, b = (_estimate(n, FP32, timing=host_bound) for n in (6, 8))
    assert b.detail["host_s"] - a.detail["host_s"] == pytest.approx(10e-3, rel=1e-9)


@pytest.mark.parametrize("k", [1, 3])
def test_selective_checkpointing_of_k_blocks_is_seen_twice_by_its_dispatch_mode(k):
    est = _estimate(8, FP32.replace(checkpointing=Checkpointing(mode="selective", num_blocks=k)))
    # each selective block's 2 forward ops pass through the dispatch mode in the forward and in the recompute
    assert est.detail["time_terms"]["forward"]["sac_ops"] == 2 * 2 * k
    none = _estimate(8, FP32)
    assert none.detail["time_terms"]["forward"]["sac_ops"] == 0


@pytest.mark.parametrize("k", [2, 5])
def test_full_checkpointing_of_k_blocks_adds_exactly_their_forward(plain, k):
    est = _estimate(8, FP32.replace(checkpointing=Checkpointing(mode="full", num_blocks=k)))
    base = plain[8].detail["time_terms"]["backward"]
    extra = est.detail["time_terms"]["backward"]
    fp32_peak = memopt.load_hardware("h200").flops("fp32")
    # the recompute of one block: one D x D matmul over the micro-batch's tokens, and its relu
    assert extra["matmul"] - base["matmul"] == pytest.approx(k * 2 * TOKENS * D * D / fp32_peak, rel=1e-9)
    assert extra["launches"] - base["launches"] == 2 * k


@pytest.mark.parametrize("k", [2, 5])
def test_full_checkpointing_hooks_the_forward_ops_of_its_blocks(plain, k):
    # 2 forward ops per block (mm, relu) pass through the checkpoint's saved-tensor hooks; no block, no hooked op
    est = _estimate(8, FP32.replace(checkpointing=Checkpointing(mode="full", num_blocks=k)))
    assert est.detail["time_terms"]["forward"]["ckpt_ops"] == 2 * k
    assert plain[8].detail["time_terms"]["forward"]["ckpt_ops"] == 0
    hooks_only = replace(DEFAULT_TIMING, dispatch_s=0.0, micro_batch_s=0.0, sac_dispatch_s=0.0, overlap_loss=0.0,
                         ckpt_dispatch_s=1.0)
    # 1 s a hooked op dwarfs the tiny model's GPU time
    assert _estimate(8, FP32.replace(checkpointing=Checkpointing(mode="full", num_blocks=k)),
                     timing=hooks_only).detail["host_s"] == pytest.approx(2.0 * k, rel=1e-12)


@pytest.mark.parametrize("m", [2, 4])
def test_each_micro_batch_after_the_first_adds_into_every_gradient(m):
    # 8 blocks of one weight each: 8 gradients of D x D fp32, each later micro-batch one add per gradient that
    # reads both and writes one
    est = _estimate(8, Strategy(precision="fp32", micro_batch_size=16 // m, grad_accum_steps=m))
    acc = est.detail["time_terms"]["accumulate"]
    assert acc["launches"] == 8
    assert acc["memory"] == pytest.approx(3 * 8 * D * D * 4 / memopt.load_hardware("h200").hbm_bandwidth, rel=1e-12)
    host_bound = replace(DEFAULT_TIMING, dispatch_s=1.0, micro_batch_s=0.0, sac_dispatch_s=0.0, overlap_loss=0.0)
    slow = _estimate(8, Strategy(precision="fp32", micro_batch_size=16 // m, grad_accum_steps=m), timing=host_bound)
    # m passes of the traced ops, plus (m - 1) x 8 adds, at 1 s each
    assert slow.detail["host_s"] == pytest.approx(m * _launches(est) + (m - 1) * 8, rel=1e-12)
    # one micro-batch accumulates nothing
    one = _estimate(8, FP32, timing=host_bound)
    assert one.detail["host_s"] == pytest.approx(_launches(one), rel=1e-12)


def _terms(fwd_s: float, bwd_s: float, *, ops: float = 0, m: int = 1, offload_s: float = 0.0,
           opt_s: float = 0.0, opt_ops: float = 0) -> dict:
    def part(mem_s: float, launches: float) -> dict:
        return {"matmul": 0.0, "attention": 0.0, "memory": mem_s, "launches": launches, "bnb4_calls": 0.0}

    return {"forward": {**part(fwd_s, ops / 2), "sac_ops": 0.0}, "backward": part(bwd_s, ops / 2),
            "optimizer": part(opt_s, opt_ops), "micro_batches": m, "offload_s": offload_s}


TM = replace(DEFAULT_TIMING, memory_efficiency=1.0, launch_s=0.0, dispatch_s=1e-5, micro_batch_s=0.0,
             sac_dispatch_s=0.0, offload_efficiency=0.5, overlap_loss=0.0)


def test_gpu_bound_and_host_bound_passes():
    # 0.1 + 0.2 s on the GPU against 1000 ops x 10 us = 0.01 s of host time: the GPU decides, 4 micro-batches
    assert step_time(_terms(0.1, 0.2, ops=1000, m=4), TM)[0] == pytest.approx(4 * 0.3)
    # 100k ops: 1 s of host time per pass hides the GPU's 0.3 s
    step, parts = step_time(_terms(0.1, 0.2, ops=100_000, m=4), TM)
    assert step == pytest.approx(4 * 1.0) and parts["host_bound"] == 1.0


def test_offload_copies_overlap_the_forward_and_follow_the_backward():
    # 0.3 s ideal each way at half the link: 0.6 s a copy, longer than the 0.1 s forward; the copies back add to the
    # backward: 0.6 + 0.2 + 0.6
    step, parts = step_time(_terms(0.1, 0.2, offload_s=0.3), TM)
    assert step == pytest.approx(1.4) and parts["offload_copy_s"] == pytest.approx(1.2)
    # a forward longer than its copies hides them: 1.0 + 0.2 + 0.6
    assert step_time(_terms(1.0, 0.2, offload_s=0.3), TM)[0] == pytest.approx(1.8)


def test_the_optimizer_takes_at_least_its_launches_on_the_host():
    assert step_time(_terms(0.1, 0.2, opt_s=0.05, opt_ops=100), TM)[0] == pytest.approx(0.35)
    assert step_time(_terms(0.1, 0.2, opt_s=0.05, opt_ops=20_000), TM)[0] == pytest.approx(0.3 + 0.2)


def test_the_shorter_of_host_and_gpu_shows_by_the_overlap_loss():
    lossy = replace(TM, overlap_loss=0.2)
    # host 1 s (100k ops x 10 us) against 0.3 s of GPU: 1 + 0.2 x 0.3
    assert step_time(_terms(0.1, 0.2, ops=100_000), lossy)[0] == pytest.approx(1.06)
    # GPU 3 s against 0.01 s of host: 3 + 0.2 x 0.01
    assert step_time(_terms(1.0, 2.0, ops=1000), lossy)[0] == pytest.approx(3.002)


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(D, D, num_layers=2, batch_first=True)

    def forward(self, x):
        return self.rnn(x)[0].square().mean()


def test_a_recurrent_layer_is_one_host_call_whose_time_steps_run_one_after_another():
    """cuDNN's fused kernel: the host issues one call per layer stack whatever the length, and the GPU runs each time
    step of each layer in turn (forward 1 kernel, backward 2, plus one weight-gradient pass per layer)."""
    slow_steps = replace(DEFAULT_TIMING, recurrent_step_s=1e-3)
    est = {}
    for steps in (8, 32):
        prof = memopt.profile(Recurrent(), torch.randn(16, steps, D), hardware="h200", use_cache=False)
        est[steps] = (memopt.estimate(prof, FP32, exact_reserved=False),
                      memopt.estimate(prof, FP32, exact_reserved=False, timing=slow_steps))
    terms = {s: e[0].detail["time_terms"] for s, e in est.items()}
    assert _launches(est[32][0]) == _launches(est[8][0])  # the host's ops do not grow with the sequence
    assert terms[8]["forward"]["library_kernels"] == 2 * 8
    assert terms[8]["backward"]["library_kernels"] == 2 * (2 * 8 + 1)
    # 24 more steps, 2 layers, 3 kernels a step, at 1 ms each: the only change in the GPU's time beyond FLOPs
    def gpu(e):
        return e.detail["forward_s"] + e.detail["backward_s"]

    more = gpu(est[32][1]) - gpu(est[8][1])
    base = gpu(est[32][0]) - gpu(est[8][0])
    assert more - base == pytest.approx(2 * 24 * 3 * (1e-3 - DEFAULT_TIMING.recurrent_step_s), rel=1e-6)


def test_a_recurrent_chain_takes_its_steps_or_its_flops_whichever_is_longer():
    """Each time step's small GEMMs run inside the step: a short, wide layer is bound by its FLOPs, a long narrow
    one by the latency of its steps, and never the two added (on an H100 the sum overshot large layers by 40-80%)."""
    tm = DEFAULT_TIMING
    narrow = {"library_kernels": 3000.0, "library_matmul": 1e-4}
    wide = {"library_kernels": 30.0, "library_matmul": 0.5}
    assert library_time(narrow, tm) == pytest.approx(3000 * tm.recurrent_step_s)
    assert library_time(wide, tm) == pytest.approx(0.5 / tm.matmul_efficiency)
    base = {"matmul": 0.0, "attention": 0.0, "memory": 0.0, "launches": 0.0}
    assert terms_time({**base, **wide}, tm) == pytest.approx(library_time(wide, tm))
