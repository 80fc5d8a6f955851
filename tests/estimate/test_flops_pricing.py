"""The FLOPs a step is priced at, against counts by hand: a mixture-of-experts' grouped GEMMs (2 x m x n x k for every
product, the expert groups splitting one of the dimensions between them), and half precision on a GPU without bf16."""

from __future__ import annotations

import pytest
import torch

from memopt.profile.costs import CostRecorder

GROUPED_MM = torch.ops.aten._grouped_mm.default


def _flops(a_shape, b_shape, out_shape) -> float:
    costs = CostRecorder(lambda: 0)
    a = torch.empty(a_shape, dtype=torch.bfloat16, device="meta")
    b = torch.empty(b_shape, dtype=torch.bfloat16, device="meta")
    costs(GROUPED_MM, (a, b), torch.empty(out_shape, dtype=torch.bfloat16, device="meta"))
    return costs.costs[0].matmul_flops["bf16"]


def test_grouped_gemm_flops_by_hand():
    experts, tokens, hidden, inter = 60, 32768, 2048, 1408
    # forward: every routed token's rows times its expert's weight (tokens x hidden) x (experts, hidden, inter)
    assert _flops((tokens, hidden), (experts, hidden, inter), (tokens, inter)) == 2 * tokens * hidden * inter
    # the weight gradient: (hidden, tokens) x (tokens, inter), the tokens split among the experts. It was counted
    # 2 x experts x hidden x inter x hidden: 3.75x too many here, and 6-9x the backward of a Qwen2-MoE step
    assert _flops((hidden, tokens), (tokens, inter), (experts, hidden, inter)) == 2 * hidden * inter * tokens
    # batched per expert: (experts, m, k) x (experts, k, n)
    batched = _flops((experts, 64, hidden), (experts, hidden, inter), (experts, 64, inter))
    assert batched == 2 * experts * 64 * hidden * inter


def test_fp16_autocast_is_priced_at_fp16s_peak_on_a_gpu_without_bf16():
    """A T4 has no bf16; an fp16 autocast plan is traced as the bf16 one, so its FLOPs are recorded as bf16. They
    raised 'no FLOP/s figure for bf16' and every fp16 candidate was dropped: both T4 recipes planned fp32."""
    import memopt
    from memopt.hardware import load_hardware

    t4 = load_hardware("t4")
    assert "bf16" not in t4.peak_flops and t4.flops("bf16") == t4.flops("fp16")
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024))
    sample = (torch.randn(64, 1024), torch.randn(64, 1024))
    prof = memopt.profile(model, sample=sample, hardware=t4, loss_fn=lambda out, b: (out - b[1]).pow(2).mean())
    half = memopt.estimate(prof, memopt.Strategy(precision="fp16_autocast", micro_batch_size=64), hardware=t4)
    full = memopt.estimate(prof, memopt.Strategy(precision="fp32", micro_batch_size=64), hardware=t4)
    assert half.detail["time_terms"]["forward"]["matmul"] * t4.flops("fp16") == \
        pytest.approx(full.detail["time_terms"]["forward"]["matmul"] * t4.flops("fp32"), rel=1e-6)


def test_a_profile_traced_for_one_gpu_generation_is_not_estimated_for_another():
    """A T4's profile estimated for an H100 gave 12.26 GiB with math attention where the H100's own profile gives
    7.03 GiB with cuDNN's: the kernels are chosen at the trace. The same GPU's profile still estimates."""
    import memopt

    sample = {"batch_size": 2, "seq_len": 32}
    t4 = memopt.profile("tiny_gpt2", sample=sample, hardware="t4")
    with pytest.raises(ValueError, match=r"traced for t4 \(sm75\), not for h100_80gb \(sm90\).*hardware='h100_80gb'"):
        memopt.estimate(t4, memopt.Strategy(micro_batch_size=2), hardware="h100_80gb")
    assert memopt.estimate(t4, memopt.Strategy(micro_batch_size=2), hardware="t4").peak_allocated_bytes > 0
