"""Quantized frozen weights (bitsandbytes 4-bit / 8-bit): storage and temporaries against hand-computed truths,
the fake-tensor stand-ins against bitsandbytes' CUDA code paths, the NF4 error, loading quantized, QLoRA traced on
fake tensors against a real CPU run, and the plan's wording."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

from memopt.models import SampleSpec, build_model, load_model_spec, make_batch
from memopt.profile.tracker import ALLOC, MemoryTracker
from memopt.strategy import Strategy
from memopt.techniques.adapters import AdapterSetting, find_target_linears, target_shapes
from memopt.techniques.quantization import (
    QuantSetting,
    extras_label,
    fidelity_needs,
    method_change_note,
    qlora,
    with_extra,
)
from memopt.techniques.quantization_apply import apply_quantization, quantization_targets, quantize_linear
from memopt.techniques.quantized_bytes import (
    dequant_temporaries,
    dequant_time_s,
    dequant_traffic_bytes,
    quantized_storage_bytes,
    quantized_weight_bytes,
)
from memopt.techniques.quantized_load import load_quantized
from memopt.units import allocator_size

pytestmark = pytest.mark.filterwarnings("ignore:Paged optimizers are not supported on CPU")
MiB = 1024 * 1024
SPEC = load_model_spec("tiny_llama")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = build_model("tiny_llama", device="cpu", attn_implementation="eager").eval()
    batch = make_batch(SPEC, SampleSpec.parse({"batch_size": 2, "seq_len": 32}, SPEC), device="cpu")
    return model, batch


# ---------------------------------------------------------------------------------------------------------------
# settings and strategy
# ---------------------------------------------------------------------------------------------------------------

def test_settings_parse_validate_and_round_trip_through_strategy():
    assert QuantSetting.parse({"bits": 8}) == QuantSetting(bits=8)
    assert QuantSetting.parse((("bits", 4), ("quant_type", "fp4"))).quant_type == "fp4"
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        QuantSetting(bits=3)
    with pytest.raises(ValueError, match="unknown quantization setting"):
        QuantSetting.parse({"bits": 4, "group": 2})
    s = qlora(Strategy(precision="bf16_autocast"), r=8)
    assert s.optimizer == "paged_adamw8bit" and [k for k, _ in s.extras] == ["adapters", "quantization"]
    assert s.extra("quantization")["bits"] == 4 and s.extra("adapters")["r"] == 8  # read-only dicts
    assert hash(s) == hash(qlora(Strategy(precision="bf16_autocast"), r=8))  # strategies stay hashable
    with pytest.raises(TypeError, match="read-only"):
        s.extra("adapters")["r"] = 4
    back = Strategy.from_dict(json.loads(json.dumps(s.to_dict())))  # through a plan file
    assert QuantSetting.parse(back.extra("quantization")) == QuantSetting(bits=4)
    assert AdapterSetting.parse(back.extra("adapters")) == AdapterSetting(kind="lora", r=8, alpha=16)
    assert with_extra(s, "quantization", None).extra("quantization") is None
    assert extras_label(s) == "lora(r=8,alpha=16) nf4+dq" and extras_label(Strategy()) == ""
    with pytest.raises(ValueError, match="invalid adapter setting"):
        with_extra(Strategy(), "adapters", {"kind": "ia3"})


def test_method_change_note_and_fidelity():
    assert method_change_note(Strategy()) is None
    note = method_change_note(qlora(r=16))
    assert note.startswith("Training method changed:")
    assert "LoRA adapters of rank 16" in note and "4-bit NF4" in note and "frozen" in note
    assert "8-bit" in method_change_note(qlora(bits=8))
    assert "do not train" in method_change_note(with_extra(Strategy(), "quantization", QuantSetting()))
    assert fidelity_needs(qlora()) == {"quantized_weights", "adapters"}
    assert fidelity_needs(with_extra(Strategy(), "adapters", {"r": 8})) == {"adapters"}


def test_quantization_targets_follow_hugging_face():
    t5 = build_model("tiny_t5", device="meta")
    names = quantization_targets(t5)
    assert names and not any(n.endswith(".wo") for n in names)  # T5 keeps wo in fp32 (_keep_in_fp32_modules)
    assert any(n.endswith(".wo") for n in find_target_linears(t5))  # adapters may still go there
    gpt2 = build_model("tiny_gpt2", device="meta")
    assert quantization_targets(gpt2) == []  # Conv1D projections: bitsandbytes has no quantized Conv1D
    assert len(find_target_linears(gpt2, include_conv1d=True)) == 8
    with pytest.raises(ValueError, match="Conv1D"):
        apply_quantization(gpt2, QuantSetting())


# ---------------------------------------------------------------------------------------------------------------
# estimator pieces: hand-computed truths
# ---------------------------------------------------------------------------------------------------------------

def test_storage_bytes_hand_computed():
    # 4096 x 4096 NF4 with double quantization: 8 MiB of codes; 262144 blocks of 64 -> 256 KiB of uint8 scales;
    # 1024 nested blocks -> 4 KiB fp32 + the 1 KiB code copy + the 4-byte offset; the 64-byte 4-bit code
    q = quantized_weight_bytes(4096, 4096, QuantSetting(), rounded=False)
    assert (q.codes, q.scales, q.nested, q.constants) == (8 * MiB, 256 * 1024, 4096 + 1024 + 4, 64)
    assert q.total == 8_655_940
    # as the allocator hands it out: the offset and the 4-bit code take 512 bytes each
    assert quantized_weight_bytes(4096, 4096, QuantSetting()).total == 8 * MiB + 256 * 1024 + 4096 + 1024 + 512 + 512
    # without double quantization: fp32 scale per block = 1 MiB
    assert quantized_weight_bytes(4096, 4096, QuantSetting(double_quant=False)).total == 8 * MiB + MiB + 512
    # 8-bit: 16 MiB int8 + 16 KiB of fp32 row scales
    assert quantized_weight_bytes(4096, 4096, QuantSetting(bits=8)).total == 16 * MiB + 16 * 1024
    # odd sizes: 3 x 5 = 15 values -> 8 code bytes, one block, one nested block
    odd = quantized_weight_bytes(3, 5, QuantSetting(), rounded=False)
    assert (odd.codes, odd.scales, odd.nested) == (8, 1, 4 + 1024 + 4)
    shapes = [(4096, 4096), (1024, 4096)]
    assert quantized_storage_bytes(shapes, QuantSetting()) == sum(
        quantized_weight_bytes(o, i, QuantSetting()).total for o, i in shapes)


def test_storage_bytes_match_bitsandbytes_and_the_stand_in():
    setting = QuantSetting()
    linear = nn.Linear(320, 192, bias=False)
    q = quantize_linear(linear, setting)
    qs = q.weight.quant_state
    real = [q.weight, qs.absmax, qs.code, qs.offset, qs.state2.absmax, qs.state2.code]
    assert sum(allocator_size(t.untyped_storage().nbytes()) for t in real) == \
        quantized_weight_bytes(192, 320, setting).total
    with FakeTensorMode():
        from memopt.profile.quant_stand_ins import FakeLinear4bit

        fake = FakeLinear4bit.from_linear(nn.Linear(320, 192, bias=False), compute_dtype=torch.bfloat16)
        stored = [fake.weight, *fake.buffers()]
        assert [tuple(t.shape) for t in stored] == [tuple(t.shape) for t in
                                                    (q.weight, qs.absmax, qs.code, qs.offset, qs.state2.absmax,
                                                     qs.state2.code)]
        assert sum(allocator_size(t.untyped_storage().nbytes()) for t in stored) == \
            quantized_weight_bytes(192, 320, setting).total
    q8 = quantize_linear(linear, QuantSetting(bits=8))
    assert q8.weight.dtype == torch.int8 and q8.weight.SCB.shape == (192,)
    assert allocator_size(q8.weight.numel()) + allocator_size(4 * 192) == \
        quantized_weight_bytes(192, 320, QuantSetting(bits=8)).total


def test_dequant_temporaries_and_time_hand_computed():
    t = dequant_temporaries(4096, 4096, QuantSetting(), tokens=4096)
    # forward: absmax dequantized (1 MiB fp32) and + offset (1 MiB), the bf16 weight (32 MiB); backward: 1 + 32
    assert t.forward == 2 * MiB + 32 * MiB and t.backward == MiB + 32 * MiB
    # H200 dispatch: a 28672 x 4096 weight at 64 rows takes the fused kernel (no temporary), at 65 rows it does not
    assert dequant_temporaries(28672, 4096, QuantSetting(), tokens=64).forward == 0
    assert dequant_temporaries(28672, 4096, QuantSetting(), tokens=65).forward == 2 * 7 * MiB + 7 * 32 * MiB
    assert dequant_temporaries(4096, 4096, QuantSetting(), tokens=8).forward == 34 * MiB  # < half a wave: never
    e = dequant_temporaries(4096, 4096, QuantSetting(bits=8), tokens=1024)
    # forward: int8 input 4 MiB + scales 4 KiB + int32 result 16 MiB + fp16 result 8 MiB (> fp16 input copy 8 MiB)
    assert e.forward == 4 * MiB + 4096 + 16 * MiB + 8 * MiB
    assert e.backward == 64 * MiB + 16 * 1024  # fp32 dequantized weight + the row-scale factor
    fwd_dq, _ = dequant_traffic_bytes(4096, 4096, QuantSetting())
    assert fwd_dq == 8 * MiB + (256 * 1024 + 4096 + 1024 + 4 * MiB) + 32 * MiB  # fp32 scales: written, read 3 times
    fwd, bwd = dequant_traffic_bytes(4096, 4096, QuantSetting(double_quant=False))
    assert fwd == bwd == 8 * MiB + MiB + 32 * MiB  # read codes and scales, write bf16
    hbm = 4.8e12
    assert dequant_time_s([(4096, 4096)], QuantSetting(double_quant=False), hbm) == pytest.approx(2 * fwd / hbm)
    assert dequant_time_s([(4096, 4096)], QuantSetting(double_quant=False), hbm, forward_passes=2) == \
        pytest.approx(3 * fwd / hbm)


def test_gemm_dispatch_port():
    from memopt.techniques.gemm_4bit_dispatch import gemm_4bit_uses_fused_kernel as fused

    assert fused(4, 4096, 4096, torch.bfloat16)  # tiny M: always the fused kernel
    assert not fused(2048, 4096, 4096, torch.bfloat16)  # > 1536 rows: dequantize + F.linear
    assert not fused(16, 4096, 4100, torch.bfloat16)  # K not divisible by the block size
    # sm90, 132 SMs: n_blocks = N / 64 = 448 >= 3 x 132 -> up to 64 rows
    assert fused(64, 28672, 4096, torch.bfloat16) and not fused(65, 28672, 4096, torch.bfloat16)
    assert fused(32, 8704, 4096, torch.bfloat16) and not fused(33, 8704, 4096, torch.bfloat16)  # 1 wave: 32 rows
    assert not fused(8, 4096, 4096, torch.bfloat16)  # 64 blocks of N, under half a wave: dequantize always
    assert not fused(8, 4096, 4096, torch.float32)  # fp32: SIMT only below 8 rows
    sm89 = {"major": 8, "minor": 9, "num_sms": 128}  # the fallback tiers: >= 3 waves of N-blocks -> 256 rows
    assert fused(256, 28672, 4096, torch.bfloat16, **sm89) and not fused(257, 28672, 4096, torch.bfloat16, **sm89)


# ---------------------------------------------------------------------------------------------------------------
# stand-ins: the allocations of bitsandbytes' CUDA path
# ---------------------------------------------------------------------------------------------------------------

def _events(tracker: MemoryTracker) -> list[tuple[int, int]]:
    return [(kind, allocator_size(size)) for kind, _key, size, _phase, _label in tracker.run.events]


def _forward_backward_events(layer: nn.Module, m: int, k: int) -> tuple[list, list, torch.Tensor]:
    """The (kind, bytes) events of one forward and one backward of ``layer`` on a fake (1, m, k) input, and
    that input."""
    x = torch.empty(1, m, k, requires_grad=True)
    tracker = MemoryTracker("cpu")
    with tracker:
        for t in [*layer.parameters(), *layer.buffers(), x]:
            tracker.track(t)
        start = len(tracker.run.events)
        y = layer(x)
        forward = _events(tracker)[start:]
        y.sum().backward()
    return forward, _events(tracker)[start + len(forward):], x


def test_fake_linear4bit_allocates_like_cuda():
    from memopt.profile.quant_stand_ins import FakeLinear4bit

    m, k, n = 2048, 256, 512  # more than 1536 rows: the unfused GEMM
    blocks = n * k // 64
    with FakeTensorMode():
        layer = FakeLinear4bit.from_linear(nn.Linear(k, n, bias=False), compute_dtype=torch.bfloat16)
        forward, backward, x = _forward_backward_events(layer, m, k)
    a = ALLOC
    assert forward == [
        (a, m * k * 2),  # input cast to bf16
        (a, blocks * 4), (a, blocks * 4),  # nested absmax dequantized, + offset
        (a, n * k * 2),  # the dequantized bf16 weight
        (a, m * n * 2),  # GEMM output
        (-1, blocks * 4), (-1, blocks * 4), (-1, n * k * 2),  # temporaries die with the kernel
        (a, m * n * 4),  # output cast back to fp32
        (-1, m * k * 2), (-1, m * n * 2),  # nothing saved for backward but the packed weight
    ]
    assert backward[2:] == [
        (a, m * n * 2),  # grad_output cast to bf16 (for the bf16 GEMM output)
        (a, blocks * 4), (a, n * k * 2), (-1, blocks * 4),  # F.dequantize_4bit: nested absmax, then the weight
        (a, m * k * 2), (-1, n * k * 2), (-1, m * n * 2),  # grad of the bf16 input; temporaries freed
        (a, m * k * 4), (-1, m * k * 2),  # its cast back to the fp32 input's dtype
        (-1, 512), (-1, 512),  # loss and its gradient seed
    ]
    assert x.grad is not None and x.grad.shape == x.shape


def test_fake_linear4bit_fused_kernel_and_no_grad_paths():
    from memopt.profile.quant_stand_ins import FakeLinear4bit

    with FakeTensorMode():
        layer = FakeLinear4bit.from_linear(nn.Linear(4096, 4096, bias=False), compute_dtype=torch.bfloat16)
        x = torch.empty(1, 4, 4096, dtype=torch.bfloat16)  # 4 rows: the fused kernel, no temporaries
        tracker = MemoryTracker("cpu")
        with tracker:
            for t in [*layer.parameters(), *layer.buffers(), x]:
                tracker.track(t)
            start, base = len(tracker.run.events), tracker.current_bytes
            out = layer(x)
            assert _events(tracker)[start:] == [(ALLOC, 4 * 4096 * 2)]  # only the output
            assert tracker.peak_bytes == base + 4 * 4096 * 2
            x8 = torch.empty(1, 8, 4096, dtype=torch.bfloat16)  # 8 rows, 64 N-blocks: dequantize + F.linear
            start = len(tracker.run.events)
            out = layer(x8)
            assert (ALLOC, 4096 * 4096 * 2) in _events(tracker)[start:]
        assert out.shape == (1, 8, 4096)


def test_fake_linear8bit_allocates_like_cuda():
    from memopt.profile.quant_stand_ins import FakeLinear8bitLt

    m, k, n = 64, 256, 512
    with FakeTensorMode():
        layer = FakeLinear8bitLt.from_linear(nn.Linear(k, n, bias=False))
        forward, backward, x = _forward_backward_events(layer, m, k)
    a = ALLOC
    assert forward == [
        (a, m * k * 2),  # A.to(float16)
        (a, m * k), (a, allocator_size(m * 4)),  # int8 rows + fp32 row scales
        (-1, m * k * 2),
        (a, m * n * 4),  # int32 accumulator
        (a, m * n * 2),  # fp16 result
        (a, m * n * 4),  # .to(A.dtype)
        (-1, m * n * 4), (-1, m * n * 2), (-1, m * k), (-1, allocator_size(m * 4)),
    ]  # the input itself is what is kept for backward (ctx.tensors)
    assert (a, n * k * 4) in backward  # the weight dequantized in the input dtype
    assert x.grad is not None


# ---------------------------------------------------------------------------------------------------------------
# real bitsandbytes on CPU
# ---------------------------------------------------------------------------------------------------------------

def test_nf4_error_and_undo(tiny):
    model, batch = tiny
    names = find_target_linears(model)
    assert len(names) == 14
    originals = {n: model.get_submodule(n) for n in names}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = [model.get_submodule(n).register_forward_hook(
        lambda mod, args, out, n=n: seen.__setitem__(n, (args[0].detach(), out.detach()))) for n in names]
    with torch.no_grad():
        ref = model(input_ids=batch["input_ids"]).logits
    for h in hooks:
        h.remove()
    undo = apply_quantization(model, QuantSetting())
    try:
        assert model.is_loaded_in_4bit
        errors = []
        with torch.no_grad():
            for n in names:
                x, y = seen[n]
                errors.append(_rel(model.get_submodule(n)(x), y))
            logits = model(input_ids=batch["input_ids"]).logits
        assert max(errors) < 0.1  # measured 0.092 mean, 0.097 max
        assert _rel(logits, ref) < 0.1  # measured 0.091
        assert all(type(model.get_submodule(n)).__name__ == "Linear4bit" for n in names)
    finally:
        undo()
    assert all(model.get_submodule(n) is originals[n] for n in names)
    assert not hasattr(model, "is_loaded_in_4bit")
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    undo8 = apply_quantization(model, QuantSetting(bits=8))
    with torch.no_grad():
        assert _rel(model(input_ids=batch["input_ids"]).logits, ref) < 0.03  # int8: measured 0.014
    undo8()


def test_load_quantized_layer_by_layer(tiny, tmp_path):
    from safetensors.torch import save_file

    model, batch = tiny
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with torch.no_grad():
        ref = model(input_ids=batch["input_ids"]).logits
    tracker = MemoryTracker("cpu")
    with tracker:
        loaded = load_quantized("tiny_llama", path, QuantSetting(), "cpu")
    loaded.eval()
    # never the full-precision model in memory: measured 282112 bytes at the peak against 427264 of fp32 weights
    assert tracker.peak_bytes < 0.7 * full_bytes
    shapes = target_shapes(loaded)
    quantized = quantized_storage_bytes(shapes, QuantSetting())
    others = sum(allocator_size(p.numel() * 4) for n, p in loaded.named_parameters() if p.dtype == torch.float32)
    assert tracker.current_bytes <= quantized + others + 4096  # what stays: the quantized model (+ rotary buffer)
    with torch.no_grad():
        logits = loaded(input_ids=batch["input_ids"]).logits
    assert _rel(logits, ref) < 0.1
    undo = apply_quantization(model, QuantSetting())  # quantizing in place gives the very same model
    try:
        with torch.no_grad():
            assert torch.equal(model(input_ids=batch["input_ids"]).logits, logits)
    finally:
        undo()
    with pytest.raises(ValueError, match="lacks"):
        save_file({"lm_head.weight": model.lm_head.weight.detach().contiguous()}, str(tmp_path / "partial.safetensors"))
        load_quantized("tiny_llama", tmp_path / "partial.safetensors", QuantSetting(), "cpu")


# ---------------------------------------------------------------------------------------------------------------
# QLoRA traced on fake tensors against a real CPU run
# ---------------------------------------------------------------------------------------------------------------

def _real_step_peaks(model: nn.Module, strategy: Strategy, batch: dict, num_steps: int = 2) -> list[int]:
    """``simulate_step``'s protocol on real tensors: track weights (and quantization state) and the batch, then
    the peak of each optimizer step. bitsandbytes' CPU GEMM runs op by op so its temporaries are seen."""
    from harness.real_step import real_step_peaks
    from memopt.profile.quant_stand_ins import quant_state_tensors, visible_bnb_kernels
    from memopt.step.prepare import prepare

    prepared = prepare(model, strategy, device_type="cpu")
    try:
        return real_step_peaks(lambda: prepared.step.step(batch),
                               [*model.parameters(), *model.buffers(), *quant_state_tensors(model), *batch.values()],
                               num_steps=num_steps, context=visible_bnb_kernels)
    finally:
        prepared.undo()


_VARIANTS = {
    "qlora": dict(optimizer="paged_adamw8bit"),
    "qlora-adamw": dict(optimizer="adamw"),
    "qlora-selective-ckpt": dict(optimizer="adamw", checkpointing="selective"),
    "qdora-full-ckpt": dict(optimizer="adamw", checkpointing="full", kind="dora"),
}


@pytest.mark.parametrize("variant", ["qlora", *(pytest.param(v, marks=pytest.mark.slow) for v in list(_VARIANTS)[1:])])
def test_fake_qlora_step_matches_real_cpu_run(tiny, variant):
    """bitsandbytes' CPU 4-bit GEMM is its pure-PyTorch kernel (``_gemm_4bit_default_impl``): dequantize, then
    F.linear — CUDA's unfused path, which the CUDA dispatch takes here (64 rows of a small weight on an H200).
    The one difference: CPU frees the dequantized fp32 absmax right after adding the offset, CUDA at the end of
    the kernel (512 bytes here, not at the peak). fp32, eager attention and no cuBLAS workspace keep everything
    else identical between the CPU run and the emulated GPU trace."""
    from memopt.profile.cuda_semantics import KernelPolicy
    from memopt.profile.simulate import simulate_step
    from memopt.strategy import Checkpointing
    from memopt.techniques.gemm_4bit_dispatch import gemm_4bit_uses_fused_kernel

    model, batch = tiny
    sample = SampleSpec.parse({"batch_size": 2, "seq_len": 32}, SPEC)
    v = _VARIANTS[variant]
    base = Strategy(micro_batch_size=2, checkpointing=Checkpointing(mode=v.get("checkpointing", "none")))
    strategy = qlora(base, r=8, optimizer=v["optimizer"], kind=v.get("kind", "lora"))
    assert not any(gemm_4bit_uses_fused_kernel(64, o, i, torch.bfloat16) for o, i in target_shapes(model))
    fake = simulate_step(model, lambda d: make_batch(SPEC, sample, device=d), strategy,
                         policy=KernelPolicy(cublas_workspace_bytes=0))
    model.train()
    try:
        real = _real_step_peaks(model, strategy, batch)
    finally:
        model.eval()
    # measured: identical with torch AdamW (all variants); with paged 8-bit AdamW the stand-in optimizer allocates
    # the two 1 KiB quantization maps that bitsandbytes skips when every tensor is below 4096 values (2048 bytes
    # of 1234944, 0.17%)
    assert fake.step_peaks[0] == real[0]
    assert abs(fake.peak_allocated_bytes - max(real)) <= 0.01 * max(real)
    if v["optimizer"] == "adamw":
        assert fake.step_peaks == real


@pytest.mark.slow
def test_fake_trace_of_quantized_variants_runs():
    """DoRA over 4-bit, LoRA over 8-bit, and QLoRA with checkpointing under bf16 autocast all trace."""
    from memopt.profile.cuda_semantics import KernelPolicy
    from memopt.profile.simulate import simulate_step
    from memopt.strategy import Checkpointing

    model = build_model("tiny_llama", device="meta")
    sample = SampleSpec.parse({"batch_size": 2, "seq_len": 32}, SPEC)
    peaks = {}
    for name, s in [("qdora", qlora(r=8, kind="dora")), ("q8", qlora(r=8, bits=8)),
                    ("ckpt", qlora(Strategy(precision="bf16_autocast", checkpointing=Checkpointing(mode="full")),
                                   r=8))]:
        res = simulate_step(model, lambda d: make_batch(SPEC, sample, device=d), s,
                            policy=KernelPolicy(cublas_workspace_bytes=0), num_steps=1)
        peaks[name] = res.peak_allocated_bytes
    assert all(p > 0 for p in peaks.values())
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear  # the user's model is never touched


def test_quantized_layers_keep_the_mode_of_the_layers_they_replace(tiny):
    """bitsandbytes chooses its CPU kernel by the module's mode: a layer quantized into an eval model that came
    out in training mode computed with another kernel than the same layer loaded quantized and put in eval."""
    model, _ = tiny
    for mode in (False, True):
        model.train(mode)
        undo = apply_quantization(model, QuantSetting())
        try:
            quantized = [m for m in model.modules() if type(m).__name__ == "Linear4bit"]
            assert quantized and all(m.training is mode for m in quantized)
        finally:
            undo()
