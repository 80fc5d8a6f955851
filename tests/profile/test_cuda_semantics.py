"""The CPU emulation of CUDA's memory semantics: autocast policy, dropout, attention kernels."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from memopt.profile.attention_select import AttentionPolicy, UnsupportedAttention, choose_backend
from memopt.profile.cuda_semantics import KernelPolicy, cuda_semantics
from memopt.profile.tracker import MemoryTracker
from memopt.techniques.attention import sdpa_restricted

H90 = KernelPolicy(attention=AttentionPolicy(sm=90))
H90_CUDNN = KernelPolicy(attention=AttentionPolicy(sm=90, prefer_cudnn=True))


def test_cuda_autocast_policy_replaces_cpus():
    x = torch.randn(4, 8)
    w = torch.randn(8, 8, requires_grad=True)
    with cuda_semantics(H90), torch.autocast("cpu", dtype=torch.bfloat16):
        y = x @ w
        assert y.dtype == torch.bfloat16  # lower-precision list
        assert y.pow(2).dtype == torch.float32  # CUDA: fp32 list (CPU would keep bf16)
        assert y.sum().dtype == torch.float32  # fp32_set_opt_dtype
        assert y.mean().dtype == torch.bfloat16  # in no list
        assert F.cross_entropy(y, torch.zeros(4, dtype=torch.long)).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (x @ w).pow(2).dtype == torch.bfloat16  # CPU's own policy is back


def test_dropout_keeps_a_one_byte_mask():
    x = torch.randn(1024, 1024, requires_grad=True)
    with cuda_semantics(H90), MemoryTracker("cpu") as t:
        y = F.dropout(x, 0.1, training=True)
        saved = t.current_bytes - y.untyped_storage().nbytes()
    assert type(y.grad_fn).__name__ == "NativeDropoutBackward0"
    assert saved == 1024 * 1024  # bool mask, not a float noise tensor
    with MemoryTracker("cpu") as t:
        y = F.dropout(x, 0.1, training=True)
        assert t.current_bytes - y.untyped_storage().nbytes() == 4 * 1024 * 1024  # CPU path, for contrast


def _qkv(b, h, hk, length, d, dtype):
    q = torch.randn(b, length, h, d, dtype=dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(b, length, hk, d, dtype=dtype).transpose(1, 2).requires_grad_()
    v = torch.randn(b, length, hk, d, dtype=dtype).transpose(1, 2).requires_grad_()
    return q, k, v


def test_backend_selection_follows_cuda_rules():
    with FakeTensorMode():
        q, k, v = _qkv(2, 8, 8, 128, 64, torch.bfloat16)
        assert choose_backend(q, k, v, None, 0.0, True, False, H90.attention) == "flash"
        assert choose_backend(q, k, v, None, 0.0, True, False, H90_CUDNN.attention) == "cudnn"
        mask = torch.zeros(2, 8, 128, 128, dtype=torch.bfloat16)
        assert choose_backend(q, k, v, mask, 0.0, False, False, H90.attention) == "efficient"
        # a learned mask (Swin's, T5's position bias): only the memory-efficient kernel differentiates it, and
        # cuDNN, first on an H200, refuses it (measured: scripts/sdpa_mask_grad_probe_gpu.py)
        learned = mask.clone().requires_grad_()
        assert choose_backend(q, k, v, learned, 0.0, False, False, H90.attention) == "efficient"
        assert choose_backend(q, k, v, learned, 0.1, False, False, H90_CUDNN.attention) == "efficient"
        assert choose_backend(q, k, v, mask, 0.0, False, False, H90_CUDNN.attention) == "cudnn"
        # a mask whose last dim is strided (T5's permuted bias in transformers 5.17): no fused kernel takes it
        strided = torch.zeros(1, 128, 128, 8, dtype=torch.bfloat16).permute(0, 3, 1, 2)
        assert choose_backend(q, k, v, strided, 0.0, False, False, H90_CUDNN.attention) == "math"
        assert choose_backend(q, k, v, strided.requires_grad_(), 0.0, False, False, H90.attention) == "math"
        column = torch.zeros(2, 8, 128, 1, dtype=torch.bfloat16).expand(2, 8, 128, 1)
        assert choose_backend(q, k, v, column.as_strided(column.shape, (1024, 128, 1, 7)), 0.0, False, False,
                              H90.attention) == "efficient"  # a size-1 last dim has no stride to check
        q32, k32, v32 = _qkv(2, 8, 8, 128, 64, torch.float32)
        assert choose_backend(q32, k32, v32, None, 0.0, True, False, H90.attention) == "efficient"
        qg, kg, vg = _qkv(2, 8, 2, 128, 64, torch.float32)  # fp32 grouped-query: only math
        assert choose_backend(qg, kg, vg, None, 0.0, True, True, H90.attention) == "math"
        sm75 = AttentionPolicy(sm=75)
        assert choose_backend(q, k, v, None, 0.0, True, False, sm75) != "flash"

    with sdpa_restricted("flash"), FakeTensorMode():
        q, k, v = _qkv(1, 2, 2, 16, 64, torch.float32)  # flash cannot take fp32, nothing else is enabled
        with pytest.raises(UnsupportedAttention):
            choose_backend(q, k, v, None, 0.0, True, False, H90.attention)


@pytest.mark.parametrize("policy", [H90, H90_CUDNN])
@pytest.mark.parametrize("gqa", [False, True])
def test_emulated_attention_computes_the_right_values(policy, gqa):
    torch.manual_seed(0)
    q, k, v = _qkv(2, 4, 2 if gqa else 4, 32, 16, torch.bfloat16)
    ref_q, ref_k, ref_v = (t.detach().float().requires_grad_() for t in (q, k, v))
    with cuda_semantics(policy):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    out.float().square().sum().backward()
    rk, rv = ref_k, ref_v
    if gqa:
        rk, rv = ref_k.repeat_interleave(2, dim=1), ref_v.repeat_interleave(2, dim=1)
    ref = F.scaled_dot_product_attention(ref_q, rk, rv, is_causal=True)
    ref.square().sum().backward()
    assert torch.allclose(out.float(), ref, atol=3e-2, rtol=3e-2)
    for got, want in ((q.grad, ref_q.grad), (k.grad, ref_k.grad), (v.grad, ref_v.grad)):
        assert torch.allclose(got.float(), want, atol=5e-2, rtol=5e-2)


def test_flash_attention_bytes_match_the_h200_measurement():
    """benchmarks/probe: causal bf16 (2, 16, 2048, 128) on flash kept 17,040,384 B after forward and peaked
    84,148,224 B in backward (above the state after forward, incl. grad_out)."""
    with FakeTensorMode(), cuda_semantics(H90):
        q, k, v = _qkv(2, 16, 16, 2048, 128, torch.bfloat16)
        with MemoryTracker("cpu") as t:
            for x in (q, k, v):
                t.track(x)
            base = t.current_bytes
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            assert t.current_bytes - base == 17_040_384
            g = torch.randn_like(out)
            t.track(g)
            t.reset_peak()
            start = t.current_bytes
            out.backward(g)
            assert t.peak_bytes - start == 84_148_224


@pytest.mark.parametrize("mask_kind, kept_mib", [("none", 1), ("bool", 65), ("bool_broadcast_queries", 65),
                                                  ("bool_one_row", 9), ("additive_bf16", 1)])
def test_cudnn_keeps_a_converted_bool_mask_as_measured_on_an_h100(mask_kind, kept_mib):
    """scripts/sdpa_bool_mask_probe_gpu.py, torch 2.11 on an H100: one cuDNN attention call over (8, 16, 2048, 64)
    bf16 keeps, beyond its output, its softmax stats (1 MiB) and, given a bool mask, the additive bf16 mask it converts
    it to, as large as the mask's shape (a broadcast view materialized): 64 MiB for (8, 1, 2048, 2048), 8 MiB for
    (1, 1, 2048, 2048); an additive mask already in bf16 is the caller's, kept by reference. A padded batch hands
    transformers' Llama such a bool mask: the trace had predicted 64 MiB less per block than an H100 measured."""
    b, h, t, d = 8, 16, 2048, 64
    with FakeTensorMode(), cuda_semantics(H90_CUDNN):
        q, k, v = _qkv(b, h, h, t, d, torch.bfloat16)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        pad = torch.ones(b, t, dtype=torch.bool)
        mask = {"none": None, "bool": pad[:, None, None, :] & causal, "bool_one_row": causal[None, None],
                "bool_broadcast_queries": pad[:, None, None, :].expand(b, 1, t, t),
                "additive_bf16": torch.zeros(b, 1, t, t, dtype=torch.bfloat16)}[mask_kind]
        with MemoryTracker("cpu") as tracker:
            for x in (q, k, v) + ((mask,) if mask is not None else ()):
                tracker.track(x)
            base = tracker.current_bytes
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
            kept = tracker.current_bytes - base - out.numel() * out.element_size()
    assert kept / 2**20 == pytest.approx(kept_mib, abs=0.01)


def test_nothing_leaks_into_the_process():
    available = torch.cuda.is_available()
    with cuda_semantics(H90):
        pass
    assert torch.cuda.is_available() == available
    x = torch.randn(64, 64, requires_grad=True)
    assert type(F.dropout(x, 0.5, True).grad_fn).__name__ == "MulBackward0"  # CPU dropout is back


def test_softmax_temporaries_match_the_h200_log():
    """benchmarks/probe/ops_t5_full_ac.json.gz, T5's math attention (fp32 scores of shape (4, 12, 512, 512)):
    ``_safe_softmax`` peaked 12,608,000 B above its output (the ``== -inf`` mask, its row reduction and a
    scalar), ``_softmax_backward_data`` 50,331,648 B above its output (CUDA's ``tmp = grad * output``).
    Missing the second put T5-base with full checkpointing 480 MiB (6.7%) under the H200 measurement."""
    t = MemoryTracker("cpu")
    with FakeTensorMode(), cuda_semantics(H90, t):
        x = torch.randn(4, 12, 512, 512, requires_grad=True)
        with t:
            t.track(x)
            t.reset_peak()
            start = t.current_bytes
            y = torch.ops.aten._safe_softmax(x, -1)
            assert t.current_bytes - start == 50_331_648
            assert t.peak_bytes - t.current_bytes == 12_608_000
            g = torch.randn_like(y)
            t.track(g)
            t.reset_peak()
            start = t.current_bytes
            y.backward(g)
            assert t.current_bytes - start == 50_331_648  # x.grad
            assert t.peak_bytes - t.current_bytes == 50_331_648  # grad * output, freed inside the kernel


def test_efficient_attention_differentiates_a_learned_bias():
    """The memory-efficient kernel's emulation gives the bias its gradient (the math path's value on real
    tensors) and allocates it as the kernel does: one (B, H, Lq, Lk) tensor, Lk padded to 16, in the bias dtype."""
    torch.manual_seed(0)
    b, h, length, d = 2, 4, 49, 32
    q, k, v = (torch.randn(b, h, length, d, requires_grad=True) for _ in range(3))
    table = torch.randn(1, h, length, length, requires_grad=True)
    with cuda_semantics(H90, None, log := []):
        out = F.scaled_dot_product_attention(q, k, v, table * 1.0)
    assert log == ["efficient"]
    out.square().sum().backward()
    got = [t.grad.clone() for t in (q, k, v, table)]
    for t in (q, k, v, table):
        t.grad = None
    F.scaled_dot_product_attention(q, k, v, table * 1.0).square().sum().backward()  # CPU's own kernel
    for mine, ref in zip(got, (q.grad, k.grad, v.grad, table.grad)):
        torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-5)

    with FakeTensorMode():
        q, k, v = (torch.empty(b, length, h, d, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
                   for _ in range(3))
        table = torch.empty(1, h, length, length, dtype=torch.bfloat16, requires_grad=True)
        with cuda_semantics(H90), MemoryTracker("cpu") as t:
            out = F.scaled_dot_product_attention(q, k, v, table * 1.0)
            grad = torch.empty_like(out)
            t.reset_peak()
            before = t.current_bytes
            out.backward(grad)
            grads = (b * h * length * d * 2) * 3  # dq, dk, dv in bf16
            dbias = b * h * length * 64 * 2  # Lk 49 padded to 64 (the multiple of 16 above it)
            scratch = 4 * b * h * length + 4 * b * h * 64 * 64 + 256 * b * h  # delta, dq accumulator on 64 x 64
            expected = grads + dbias + scratch
            assert expected <= t.peak_bytes - before <= expected + 2048  # the allocator's 512 B rounding
    assert table.grad is not None and table.grad.shape == (1, h, length, length)
