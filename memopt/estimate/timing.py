"""Step time from the traced costs and the hardware's peaks (a calibrated roofline).

Each traced segment carries matmul FLOPs by dtype, attention FLOPs, the bytes the other ops move and
its op count. Its time is::

    sum_dtype flops / (peak[dtype] * matmul_efficiency) + attention_flops / (peak * attention_efficiency)
      + memory_bytes / (hbm_bandwidth * memory_efficiency) + num_ops * launch_s
      + max(library_kernels * recurrent_step_s, library_flops / (peak * matmul_efficiency))

The efficiencies and the host constants are fitted to step times measured on an H200 (see
``benchmarks/plan_quality/``); a GPU kind measured since overrides some in its hardware config (:func:`timing_for`).
fp32 matmuls run at the fp32 rate (PyTorch leaves TF32 off for matmuls by default).
Activation offload moves the saved tensors over the host link on a side stream: the forward waits for the previous
copy before issuing the next (one in flight), and the copies back run on the compute stream as backward unpacks them.

The host issues the kernels while the GPU runs the ones already queued: a pass of one micro-batch takes the longer
of its GPU time and its host time (:func:`host_time`), plus ``overlap_loss`` of the shorter (:func:`step_time`)::

    num_ops * dispatch_s + sac_ops * sac_dispatch_s + ckpt_ops * ckpt_dispatch_s + bnb4_calls * bnb4_call_s
      + micro_batch_s

``sac_ops`` counts the ops that selective checkpointing's Python dispatch mode intercepts: every op of a selective
block's forward, twice (forward and recompute). That is why selective checkpointing at micro-batch 1 of a 1.1B
model ran 2.9x slower than the GPU time alone predicted.

``bnb4_calls`` counts the passes through a bitsandbytes 4-bit linear (forward, recomputed forward and
backward each call it once; ``memopt.profile.costs.BNB4_CALL_OPS``): bitsandbytes runs each one through
Python and several custom-op dispatches, about half a millisecond of host time whatever the weight's size.
The bytes its dequantization moves stay in the GPU time (``memory_bytes``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from memopt.hardware import HardwareSpec
from memopt.profile.costs import PhaseCost

__all__ = ["DEFAULT_TIMING", "HOST_CONSTANTS", "TimingModel", "host_time", "optimizer_time", "pass_time",
           "segment_time", "step_time", "timing_for"]


@dataclass(frozen=True)
class TimingModel:
    """The H200's constants, fitted (``scripts/plan_quality_clock.py fit``) to the 109 configurations measured one
    row at a time in ``benchmarks/plan_quality/clock_rows.json`` (torch 2.11; wrap, speed-grid, autotune and
    estimator rows of 9 models): median error 8%, max 36%; each model predicted by constants fitted without it:
    median 12%, max 39% (``benchmarks/plan_quality/clock_fit.md``). Rows measured beside other rows were not
    fitted; issue 20's selective-checkpointing and activation-offload figures among them are predicted within 8%."""

    matmul_efficiency: float = 0.74
    attention_efficiency: float = 0.50
    memory_efficiency: float = 0.665
    launch_s: float = 8.4e-6  # GPU time of a kernel beyond its FLOPs and bytes (launch latency, tail, small grids)
    # Host seconds to issue one op in eager PyTorch (Python module code, dispatcher, cudaLaunchKernel): a pass
    # takes at least ops x this (see step_time). The GPU hides it for large micro-batches; small, fast models and
    # small micro-batches are host-bound.
    dispatch_s: float = 25.8e-6
    # More host seconds per op intercepted by selective checkpointing's TorchDispatchMode (a Python
    # __torch_dispatch__ with the policy call and the cache of saved outputs), in the forward and the recompute
    sac_dispatch_s: float = 84e-6
    # More host seconds per op of a fully checkpointed block's forward: non-reentrant torch.utils.checkpoint packs
    # each tensor the block saves through a Python hook, and its recompute runs the block's Python again under
    # another hook context that unpacks them. Fitted alone (the other constants kept) on the rows above plus the
    # hand grids of Pythia-410m and ViT-632M (benchmarks/plan_quality/speed_cases); RoBERTa-large and a tied MLP
    # held out: at micro-batch 1 full checkpointing took 2x the step of no checkpointing, where the recompute's
    # ops alone make 1.4x
    ckpt_dispatch_s: float = 35.7e-6
    micro_batch_s: float = 0.0  # host seconds per micro-batch outside the ops (the train step's Python)
    # The host and the GPU overlap imperfectly: stretches of small kernels drain the queue even in a GPU-bound pass,
    # and large kernels leave the host idle in a host-bound one. This fraction of the shorter of the two shows.
    overlap_loss: float = 0.205
    offload_efficiency: float = 0.95  # achieved fraction of the host link in each direction
    # Host time of one pass (forward, recomputed forward or backward) through a bitsandbytes 4-bit linear: a pass
    # takes at least bnb4_calls x this (see host_time). Measured, not fitted: benchmarks/quant/raw/dequant_h200.json
    # (scripts/bench_dequant.py; H200, bitsandbytes 0.50.2, torch 2.11, 2048 tokens, NF4 + double quantization,
    # frozen weight) timed a Linear4bit forward + backward back to back at 0.850, 0.939, 0.868 and 1.018 ms for the
    # Llama-3-8B shapes 4096x4096, 1024x4096, 14336x4096 and 4096x14336, against 0.233, 0.209, 0.630 and 0.654 ms
    # for the bf16 linear: flat in the weight's size while the bf16 GEMMs grow 3x, so the 4-bit layer is
    # host-bound there (a lone dequantize_4bit: ~0.1 ms at any size, 10 to 147 MB). The mean, 0.919 ms per
    # forward + backward, is two dequantizing calls: 0.46 ms each (0.42 to 0.51 over the four shapes).
    # No 8-bit layer was timed: LLM.int8 calls get no such term.
    bnb4_call_s: float = 0.46e-3
    # One allocator retry under the hard cap (the cache is flushed: a device synchronize, cudaFree / unmap of the
    # free segments and pages, then their memory mapped again as it is reused). Not fitted: an assumption of a few
    # milliseconds, so that among plans of equal compute the planner prefers one that does not lean on the cap.
    alloc_retry_s: float = 5e-3
    # GPU seconds of one time step of one layer and direction in cuDNN's recurrent kernel beyond its FLOPs: the steps
    # run one after another, each a small GEMM and its gate kernels (``memopt.profile.recurrent_kernels``; a chain
    # takes this per step or its FLOPs' time, the longer: ``library_time``). Fitted to 86 configurations probed on
    # an H100 (``benchmarks/recurrent/``: median error 15%, the three largest layers +2 to +10%); cuDNN's persistent
    # kernels run some bf16 LSTM and RNN configurations several times faster, which this does not see.
    recurrent_step_s: float = 18e-6


DEFAULT_TIMING = TimingModel()
#: the constants that are host seconds (Python, the dispatcher, kernel launches), scaled by the host's speed
HOST_CONSTANTS = ("dispatch_s", "sac_dispatch_s", "ckpt_dispatch_s", "micro_batch_s", "bnb4_call_s")


def timing_for(hw: HardwareSpec) -> TimingModel:
    """The clock's constants for a GPU kind: :data:`DEFAULT_TIMING` (fitted on an H200) with the constants its
    hardware config calibrated on that GPU (``extra.timing`` in ``configs/hardware/<name>.yaml``). A GPU measured
    by nobody keeps the H200's. Raises ``ValueError`` naming an unknown constant or a value that is not a number."""
    given = hw.extra.get("timing") or {}
    try:
        scale = float(hw.extra.get("host_scale", 1.0))
    except (TypeError, ValueError):
        scale = -1.0
    if not 0 < scale < math.inf:
        raise ValueError(f"hardware {hw.name!r}: extra.host_scale must be a positive number (this host's seconds "
                         f"per op over the fitted host's, memopt.host_speed), got {hw.extra.get('host_scale')!r}")
    if not given:
        return _host_scaled(DEFAULT_TIMING, scale)
    known = {f.name for f in fields(TimingModel)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(f"hardware {hw.name!r}: unknown timing constants {unknown} in extra.timing; "
                         f"valid: {sorted(known)}")
    try:
        values = {k: float(v) for k, v in given.items()}
    except (TypeError, ValueError):
        raise ValueError(f"hardware {hw.name!r}: extra.timing values must be numbers, got {dict(given)}") from None
    if any(v < 0 for v in values.values()):
        raise ValueError(f"hardware {hw.name!r}: extra.timing values must be >= 0, got {values}")
    return _host_scaled(replace(DEFAULT_TIMING, **values), scale)


def _host_scaled(tm: TimingModel, scale: float) -> TimingModel:
    """The constants with every host-side term scaled by the local host's measured speed (``memopt.host_speed``:
    1.0 is the host the constants were fitted on, 1.5 a host that issues ops 1.5x slower). GPU terms are kept."""
    if scale == 1.0:
        return tm
    return replace(tm, **{name: getattr(tm, name) * scale for name in HOST_CONSTANTS})


def segment_terms(c1: PhaseCost, c2: PhaseCost, b: int, hw: HardwareSpec, *, lo: int = 1, hi: int = 2
                  ) -> dict[str, float]:
    """Ideal seconds of one traced segment at micro-batch ``b`` per resource (before efficiencies):
    matmuls at the peak FLOP/s of their dtype, attention at the peak of its dtype, other ops at the HBM
    bandwidth, and the kernel launch count."""

    def lerp(a: float, c: float) -> float:
        return a if hi == lo else a + (b - lo) * (c - a) / (hi - lo)

    def flops_s(f1: dict[str, float], f2: dict[str, float]) -> float:
        return sum(lerp(f1.get(dtype, 0.0), f2.get(dtype, 0.0)) / hw.flops(dtype) for dtype in set(f1) | set(f2))

    mm = flops_s(c1.matmul_flops, c2.matmul_flops)
    attn = lerp(c1.attention_flops, c2.attention_flops)
    return {
        "matmul": mm,
        "attention": attn / hw.flops(c1.attention_dtype) if attn else 0.0,
        "memory": lerp(c1.memory_bytes, c2.memory_bytes) / hw.hbm_bandwidth,
        "launches": float(max(c1.num_ops, c2.num_ops)),
        "bnb4_calls": float(max(c1.bnb4_calls, c2.bnb4_calls)),
        "library_kernels": float(max(c1.library_kernels, c2.library_kernels)),
        "library_matmul": flops_s(c1.library_flops, c2.library_flops),
    }


def terms_time(terms: dict[str, float], tm: TimingModel = DEFAULT_TIMING) -> float:
    """GPU seconds of summed segment terms (the host floor is :func:`host_time`)."""
    return (terms["matmul"] / tm.matmul_efficiency + terms["attention"] / tm.attention_efficiency
            + terms["memory"] / tm.memory_efficiency + terms["launches"] * tm.launch_s
            + library_time(terms, tm))


def library_time(terms: dict[str, float], tm: TimingModel = DEFAULT_TIMING) -> float:
    """GPU seconds of the serial kernel chains libraries run (cuDNN's recurrent time steps): each step's small
    GEMMs run inside the step, so the chain takes its steps' latency or its FLOPs' time, whichever is longer (on an
    H100 the sum overshot large layers by 40-80%, ``benchmarks/recurrent/``)."""
    return max(terms.get("library_kernels", 0.0) * tm.recurrent_step_s,
               terms.get("library_matmul", 0.0) / tm.matmul_efficiency)


def host_time(terms: dict[str, float], tm: TimingModel = DEFAULT_TIMING) -> float:
    """Host seconds to issue summed segment terms: every op at ``dispatch_s``, every pass through a bitsandbytes
    4-bit linear at ``bnb4_call_s``, every op that selective checkpointing's dispatch mode intercepts at
    ``sac_dispatch_s`` more. A pass of one micro-batch takes ``max(GPU time, host time)``."""
    return (terms["launches"] * tm.dispatch_s + terms.get("bnb4_calls", 0.0) * tm.bnb4_call_s
            + terms.get("sac_ops", 0.0) * tm.sac_dispatch_s + terms.get("ckpt_ops", 0.0) * tm.ckpt_dispatch_s)


def pass_time(gpu_s: float, host_s: float, tm: TimingModel = DEFAULT_TIMING) -> float:
    """Seconds of one micro-batch pass whose kernels take ``gpu_s`` on the GPU and ``host_s`` to issue: the longer
    of the two, plus ``overlap_loss`` of the shorter (the queue drains in stretches of small kernels). Rising in
    both, so lower bounds of both give a lower bound of the pass."""
    return max(gpu_s, host_s) + tm.overlap_loss * min(gpu_s, host_s)


def optimizer_time(opt: dict[str, float], tm: TimingModel = DEFAULT_TIMING) -> float:
    """Seconds of the optimizer step from its terms: its kernels' GPU time, or the host's time to issue them."""
    return max(terms_time(opt, tm), opt["launches"] * tm.dispatch_s)


def step_time(terms: dict, tm: TimingModel = DEFAULT_TIMING) -> tuple[float, dict[str, float]]:
    """Seconds of one training step from its summed terms (``Estimate.detail["time_terms"]``): ``forward`` and
    ``backward`` of one micro-batch (ideal seconds per resource and counts, :func:`segment_terms`; ``sac_ops`` in
    ``forward``), ``optimizer``, ``micro_batches`` and ``offload_s`` (ideal seconds to move the offloaded bytes one
    way over the host link, per micro-batch). Returns the step and its parts::

        pass   = max(GPU, host) + overlap_loss * min(GPU, host)
                 GPU = forward + backward (+ the share of accumulating the gradients: micro-batches 2..m add
                 each into the kept one)
                 host = ops * dispatch_s + sac_ops * sac_dispatch_s + ckpt_ops * ckpt_dispatch_s + micro_batch_s
        offload: max(max(GPU forward, copy) + GPU backward + copy, host)   (copies back serialised with backward)
        step   = pass * micro_batches + max(GPU optimizer, optimizer ops * dispatch_s)
    """
    fwd, bwd, opt = terms["forward"], terms["backward"], terms["optimizer"]
    m = terms["micro_batches"]
    fwd_s, bwd_s = terms_time(fwd, tm), terms_time(bwd, tm)
    # the gradient accumulation of micro-batches 2..m, spread over the passes: its ops are issued in backward
    accumulate = terms.get("accumulate", {})
    share = (m - 1) / m if m > 1 else 0.0
    acc_ops = accumulate.get("launches", 0.0) * share
    bwd_s += share * accumulate.get("memory", 0.0) / tm.memory_efficiency + acc_ops * tm.launch_s
    summed = {k: fwd.get(k, 0.0) + bwd.get(k, 0.0) for k in set(fwd) | set(bwd)}
    summed["launches"] += acc_ops
    host_s = host_time(summed, tm) + tm.micro_batch_s
    gpu_s = fwd_s + bwd_s
    copy_s = terms.get("offload_s", 0.0) / tm.offload_efficiency
    if copy_s:
        gpu_s = max(fwd_s, copy_s) + bwd_s + copy_s
    opt_s = optimizer_time(opt, tm)
    pass_s = pass_time(gpu_s, host_s, tm)
    parts = {"forward_s": fwd_s * m, "backward_s": bwd_s * m, "optimizer_s": opt_s, "host_s": host_s * m,
             "host_bound": float(host_s > gpu_s)}
    if copy_s:
        parts["offload_copy_s"] = 2 * copy_s * m
    return pass_s * m + opt_s, parts


def segment_time(c1: PhaseCost, c2: PhaseCost, b: int, hw: HardwareSpec, tm: TimingModel = DEFAULT_TIMING, *,
                 lo: int = 1, hi: int = 2) -> float:
    """Seconds for one traced segment at micro-batch ``b`` (costs traced at ``lo`` and ``hi``, interpolated)."""
    return terms_time(segment_terms(c1, c2, b, hw, lo=lo, hi=hi), tm)
