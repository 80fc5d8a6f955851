"""The two bounds the search prunes its candidates with, neither of which needs a candidate's own trace: an optimistic
step time (:func:`optimistic_time`: the plain trace of the base precision at the candidate's micro-batch, rescaled to
its precision, plus what its techniques must at least add), below which no candidate's real time can fall, and memory
dominance (:func:`no_bigger`: a candidate that needs no more memory in every respect than one that did not fit does
not fit either). :mod:`memopt.plan.search` orders and prunes by them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from memopt.categories import MemoryCategory
from memopt.errors import UserArgumentError
from memopt.estimate.compose import pass_layout, trace_index
from memopt.estimate.timing import (
    TimingModel,
    host_time,
    optimizer_time,
    pass_time,
    segment_terms,
    terms_time,
    timing_for,
)
from memopt.hardware import HardwareSpec
from memopt.profile.profile import Profile
from memopt.profile.variant_trace import PRECISION_GROUP, VariantKey, variant_key
from memopt.strategy import Checkpointing, Strategy
from memopt.techniques.protocol import BaseTimes
from memopt.techniques.registry import TECHNIQUES

__all__ = ["no_bigger", "optimistic_time", "refined_time", "twin_time"]

_SLACK = 0.97  # optimistic times are scaled down a little: the time model is not exactly additive


# -- optimistic times --------------------------------------------------------------------------
_TERMS = ("matmul", "attention", "memory", "launches", "bnb4_calls", "library_kernels", "library_matmul")


def _pass_terms(profile: Profile, key: VariantKey, b: int, hw: HardwareSpec) -> dict[str, dict[str, float]]:
    """Summed terms of the plain pass: forward, backward, the blocks' forward, and the blocks' forward and backward
    (what every variant of the same precision runs, whatever its loss kernel)."""
    trace = profile.variant(key, b)
    modes = [[key] * n for n in profile.full_block_counts]
    layout = pass_layout({key: trace}, key, modes, profile.full_block_counts)
    out = {part: dict.fromkeys(_TERMS, 0.0) for part in ("fwd", "bwd", "blk", "blocks")}
    for part, insts in (("fwd", layout.forward), ("bwd", layout.backward)):
        for inst in insts:
            seg = trace.segments[inst.segment]
            for k, v in segment_terms(seg.cost1, seg.cost2, b, hw, lo=trace.lo, hi=trace.hi).items():
                out[part][k] += v
                if inst.block is not None:
                    out["blocks"][k] += v
                    if part == "fwd":
                        out["blk"][k] += v
    out["saved"] = {"bytes": float(_saved_activation_bytes(trace, layout, b))}
    return out


def _saved_activation_bytes(trace: Any, layout: Any, b: int) -> int:
    """Bytes the blocks keep for backward in tensors of 1 MiB and more: what offload would move."""
    cats = trace_index(trace).categories
    total = 0
    for inst in layout.forward:
        if inst.block is None:
            continue
        for kind, k, lo, hi in trace.segments[inst.segment].events:
            size = trace.size(lo, hi, b)
            if kind == 1 and cats.get(k) == MemoryCategory.ACTIVATIONS and size >= 1 << 20:
                total += size
    return total


def _rescale(terms: dict[str, float], group: str, base_group: str, hw: HardwareSpec) -> dict[str, float]:
    """Terms of another precision group, bounded from the base group's: fp32 matmuls run at the fp32 rate
    (at least the bf16 count of FLOPs at it), fp32 activations move at least as many bytes."""
    if group == base_group:
        return terms
    out = dict(terms)
    if group == "fp32" and base_group != "fp32" and "bf16" in hw.peak_flops:
        out["matmul"] = terms["matmul"] * hw.flops("bf16") / hw.flops("fp32")
        out["attention"] = terms["attention"] * hw.flops("bf16") / hw.flops("fp32")
    if group == "bf16w":
        out["memory"] = terms["memory"] * 0.5  # at most half the bytes: weights and activations halve
    return out


def optimistic_time(profile: Profile, s: Strategy, hw: HardwareSpec, base_group: str, cache: dict) -> float:
    """A lower bound of ``s``'s step time from the base precision's plain trace alone: its GPU time."""
    return max(_gpu_pass(profile, s, hw, base_group, cache), 0.0) * s.grad_accum_steps * _SLACK


def refined_time(profile: Profile, s: Strategy, hw: HardwareSpec, base_group: str, cache: dict,
                 above: float) -> float:
    """A tighter lower bound of ``s``'s step time, for a candidate the search would otherwise estimate because
    :func:`optimistic_time` is not above ``above`` (the runners-up's time): a pass takes at least the host's time to
    issue the blocks' ops of ``s``'s own plain trace (its precision and extras, no checkpointing, the plain loss:
    every variant of it runs those ops and more), and the optimizer step is added, traced as the estimate traces it.

    Those two may need traces of their own, which cost more than they save where the GPU is the limit (large
    models): they are made only where the base precision's plain trace, at half its ops, already puts the bound
    above ``above``. With another attention kernel, whose ops the plain trace does not bound, it is
    :func:`optimistic_time`."""
    gpu = max(_gpu_pass(profile, s, hw, base_group, cache), 0.0)
    gpu_only = gpu * s.grad_accum_steps * _SLACK
    if s.attention != "auto":
        return gpu_only
    tm = timing_for(hw)
    likely = _host_bound(profile, s, cache[s.micro_batch_size], tm, share=0.5)
    if pass_time(gpu, likely, tm) * s.grad_accum_steps * _SLACK <= above:
        return gpu_only
    plain = variant_key(s.replace(checkpointing=Checkpointing(), chunked_ce=0, activation_offload=False))
    key = ("own", plain, s.micro_batch_size)
    try:
        if key not in cache:
            cache[key] = _pass_terms(profile, plain, s.micro_batch_size, hw)
        opt = profile.optimizer(s.precision, s.optimizer, profile.variant(plain, s.micro_batch_size))
    except UserArgumentError:
        raise
    except ValueError:  # the variant or the optimizer cannot be traced: the candidate's estimate says why
        return gpu_only
    opt_s = optimizer_time(segment_terms(opt.cost, opt.cost, 1, hw), tm)
    host = _host_bound(profile, s, cache[key], tm)
    return (pass_time(gpu, host, tm) * s.grad_accum_steps + opt_s) * _SLACK


def _host_bound(profile: Profile, s: Strategy, terms: dict[str, dict[str, float]], tm: TimingModel,
                share: float = 1.0) -> float:
    """Host seconds of one pass of ``s``, at least: ``share`` of the blocks' ops of the plain pass ``terms``, plus
    what its techniques add to them."""
    blocks = {k: v * share for k, v in terms["blocks"].items()}
    base = BaseTimes(forward_s=0.0, backward_s=0.0, block_forward_s=0.0, block_forward_matmul_s=0.0,
                     extra={"blocks": float(max(profile.full_block_counts, default=1))},
                     block_forward_ops=terms["blk"]["launches"] * share,
                     host_op_s={"ckpt": tm.ckpt_dispatch_s, "sac": tm.sac_dispatch_s})
    host = host_time(blocks, tm) + tm.micro_batch_s
    for tech in TECHNIQUES:
        host += tech.host_lower_bound(getattr(s, tech.name), base)
    return host


def twin_time(s: Strategy, known: Mapping[Strategy, float]) -> float:
    """A lower bound of ``s``'s step time from plans already estimated: for each technique that only adds work
    (``adds_work``), the same plan without it takes no longer (``known``: step times estimated without the hard
    cap's retries; 0 when no twin is known)."""
    twins = (s.replace(**{t.name: t.off}) for t in TECHNIQUES if t.adds_work and getattr(s, t.name) != t.off)
    return max((known.get(twin, 0.0) for twin in twins), default=0.0) * _SLACK


def _gpu_pass(profile: Profile, s: Strategy, hw: HardwareSpec, base_group: str, cache: dict) -> float:
    """GPU seconds of one micro-batch pass of ``s``, at least: the base group's plain pass rescaled to its
    precision, plus what its techniques must add."""
    b = s.micro_batch_size
    if b not in cache:
        cache[b] = _pass_terms(profile, VariantKey(precision=base_group, checkpointing="none"), b, hw)
    terms = cache[b]
    group = PRECISION_GROUP[s.precision]
    fwd = _rescale(terms["fwd"], group, base_group, hw)
    bwd = _rescale(terms["bwd"], group, base_group, hw)
    blk = _rescale(terms["blk"], group, base_group, hw)
    tm = timing_for(hw)
    base = BaseTimes(forward_s=terms_time(fwd, tm), backward_s=terms_time(bwd, tm),
                     block_forward_s=terms_time(blk, tm),
                     block_forward_matmul_s=blk["matmul"] / tm.matmul_efficiency,
                     attention_s=(fwd["attention"] + bwd["attention"]) / tm.attention_efficiency,
                     extra={"blocks": float(max(profile.full_block_counts, default=1)),
                            "offload_copy_s": 0.5 * terms["saved"]["bytes"]
                            / (hw.host_link_bandwidth * tm.offload_efficiency)})
    # a frozen base (adapters) computes no weight gradients: its backward does at least half the work
    per_pass = base.forward_s + base.backward_s * (0.5 if s.extra("adapters") is not None else 1.0)
    for tech in TECHNIQUES:
        per_pass += tech.time_lower_bound(getattr(s, tech.name), base)
    return per_pass


# -- memory dominance ----------------------------------------------------------------------------
def _ac_level(c: Checkpointing, total: int) -> int:
    if c.mode == "none":
        return 0
    return c.count(total) * (2 if c.mode == "full" else 1)  # selective keeps more than full for the same blocks


def no_bigger(a: Strategy, b: Strategy, total: int) -> bool:
    """``a`` needs no more allocated memory than ``b``: same precision, optimizer, attention and loss kernels, and in
    every other respect at most as much (micro-batch) or at least as much saving (checkpointing, offload,
    chunked loss)."""
    if (a.precision, a.optimizer, a.attention, a.extras, a.ce_kernel) != \
            (b.precision, b.optimizer, b.attention, b.extras, b.ce_kernel):
        return False
    ma, mb = a.checkpointing.mode, b.checkpointing.mode
    if ma != mb and "none" not in (ma, mb):
        return False  # full and selective checkpointing are not ordered
    chunk_ok = (a.chunked_ce == b.chunked_ce or (a.chunked_ce > 0 and b.chunked_ce == 0)
                or a.chunked_ce > b.chunked_ce > 0)
    return (a.micro_batch_size <= b.micro_batch_size and chunk_ok and a.activation_offload >= b.activation_offload
            and _ac_level(a.checkpointing, total) >= _ac_level(b.checkpointing, total))
