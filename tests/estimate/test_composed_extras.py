"""The composed estimate of strategies with extras (quantized frozen base weights, LoRA adapters) against a
fake-tensor simulation of the whole model with the strategy applied for real: the truncated trace carries the
transformed model (quantized storage, frozen base, trainable adapters) and its state is extrapolated to full
depth, so the allocated peak matches (within 1%; in practice exactly)."""

import json

import pytest

import memopt
from memopt.models import with_overrides
from memopt.profile.profile import Profile
from memopt.profile.variant_trace import VariantKey, variant_key
from memopt.strategy import Checkpointing, Strategy
from memopt.techniques.adapters import AdapterSetting
from memopt.techniques.quantization import QuantSetting, qlora, with_extra

from .test_composed_vs_simulated import shared_profile, simulate_whole_step

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

BASE = Strategy(precision="bf16_autocast", micro_batch_size=2, grad_accum_steps=2)
LORA = with_extra(BASE, "adapters", AdapterSetting(r=8, alpha=16)).replace(optimizer="adamw_fused")
CONFIGS = {
    "qlora4": qlora(BASE, r=8),
    "qlora4_full_ac": qlora(BASE, r=8).replace(checkpointing=Checkpointing(mode="full")),
    "qlora8": qlora(BASE, r=8, bits=8),
    "qlora8_half_ac": qlora(BASE, r=8, bits=8).replace(checkpointing=Checkpointing(mode="full", num_blocks=3)),
    "lora": LORA,
    "lora_full_ac": LORA.replace(checkpointing=Checkpointing(mode="full")),
    "lora_bf16_pure": LORA.replace(precision="bf16_pure"),
    "qlora4_no_dq_adamw": with_extra(qlora(BASE, r=8), "quantization",
                                     QuantSetting(double_quant=False)).replace(optimizer="adamw_fused"),
}


def _compare(strategy: Strategy, layers: int = 7, hardware: str = "h200"):
    spec = with_overrides("tiny_llama", {"num_hidden_layers": layers})
    sample = {"batch_size": 4, "seq_len": 64}
    prof = shared_profile("tiny_llama", (("num_hidden_layers", layers),), tuple(sorted(sample.items())), hardware)
    est = memopt.estimate(prof, strategy, exact_reserved=True, num_steps=3)
    return (prof, est, *simulate_whole_step(spec, sample, strategy, hardware))


FAST = {"qlora4", "qlora4_full_ac", "qlora8", "lora", "lora_full_ac"}


@pytest.mark.parametrize("config", [c if c in FAST else pytest.param(c, marks=pytest.mark.slow)
                                    for c in sorted(CONFIGS)])
def test_composed_matches_simulation_with_extras(config):
    _, est, sim_alloc, sim_reserved = _compare(CONFIGS[config])
    assert abs(est.peak_allocated_bytes - sim_alloc) <= 0.01 * sim_alloc, (est.peak_allocated_bytes, sim_alloc)
    assert est.peak_reserved_bytes >= est.peak_allocated_bytes
    assert abs(est.peak_reserved_bytes - sim_reserved) <= 0.05 * sim_reserved, (est.peak_reserved_bytes,
                                                                               sim_reserved)
    assert any("/adapters=" in label for label in est.detail["variants"])


def test_a_classifiers_head_trained_beside_the_adapters_is_in_the_estimate():
    """Under LoRA a classifier's fresh head trains (memopt.techniques.adapter_merge.task_heads): the trace counts its
    gradients and optimizer states, and the estimate still equals the simulation of the whole model."""
    strategy = LORA.replace(precision="fp32")
    sample = {"batch_size": 4, "image_size": 32}
    prof = shared_profile("tiny_vit", (("num_hidden_layers", 6),), tuple(sorted(sample.items())), "h200")
    est = memopt.estimate(prof, strategy, exact_reserved=True, num_steps=3)
    sim_alloc, _ = simulate_whole_step(with_overrides("tiny_vit", {"num_hidden_layers": 6}), sample, strategy)
    assert abs(est.peak_allocated_bytes - sim_alloc) <= 0.01 * sim_alloc, (est.peak_allocated_bytes, sim_alloc)
    params, _ = prof.model_state(prof.variant(variant_key(strategy), 2))
    trainable = [shape for shape, _, grad in params if grad]
    assert (10, 64) in trainable and (10,) in trainable  # the head's weight and bias, beside lora_A and lora_B


def test_extras_variant_key_round_trips_and_changes_the_trace():
    key = variant_key(CONFIGS["qlora4"])
    assert key.quantization and key.adapters and key.has_extras
    assert json.loads(key.quantization)["bits"] == 4 and json.loads(key.adapters)["r"] == 8
    assert "/q=nf4+dq" in key.label() and "/adapters=lora(r=8,alpha=16)" in key.label()
    assert key.strategy().extra("quantization") == CONFIGS["qlora4"].extra("quantization")
    assert key.strategy().extra("adapters") == CONFIGS["qlora4"].extra("adapters")
    plain = variant_key(BASE)
    assert not plain.has_extras and plain.extras_id == "" and plain.label() == VariantKey(
        precision="amp", checkpointing="none").label()
    # the profile keeps variants with and without extras apart, and serializes both (with the model state)
    prof = memopt.profile(with_overrides("tiny_llama", {"num_hidden_layers": 6}),
                          sample={"batch_size": 2, "seq_len": 32}, hardware="h200", use_cache=False)
    traced = prof.variant(key, 2)
    assert traced.model_state is not None and prof.variant(plain, 2).model_state is None
    params, buffers = prof.model_state(traced)
    trainable = sum(1 for _, _, grad in params if grad)
    assert trainable == 2 * 7 * 6  # lora_A and lora_B on the 7 linears of each of the 6 blocks
    assert any(dtype == "uint8" for _, dtype, _ in params)  # the packed 4-bit codes
    assert buffers  # the quantization state (absmax, nested absmax and code, offset, 4-bit code)
    prof.optimizer("bf16_autocast", "paged_adamw8bit", traced)
    loaded = Profile.from_dict(json.loads(json.dumps(prof.to_dict())))
    assert loaded.variants[key.at(None)].model_state == traced.model_state
    assert loaded.optimizers == prof.optimizers


def test_bnb4_calls_set_a_host_floor_on_the_step_time():
    """Every pass through a bitsandbytes 4-bit linear (forward, recomputed forward, backward) is counted in the trace
    and costs ``bnb4_call_s`` of host time; a micro-batch's pass takes max(GPU time, host time). Hand-counted:
    3 blocks x 7 linears, 2 x 1024 = 2048 rows per micro-batch (the unfused forward: dequantize_4bit + linear)."""
    from dataclasses import replace

    from memopt.estimate.timing import DEFAULT_TIMING

    layers, m = 3, 2
    n = 7 * layers
    frozen_input = 3  # the first block's q, k, v read the frozen embedding's output: no gradient, no backward call
    prof = memopt.profile(with_overrides("tiny_llama", {"num_hidden_layers": layers}),
                          sample={"batch_size": 4, "seq_len": 1024}, hardware="h200", use_cache=False)
    full_ac = Checkpointing(mode="full")
    expected = {"qlora4": n + (n - frozen_input),                     # forward + backward
                "qlora4_full_ac": n + n + (n - frozen_input),         # forward + recomputed forward + backward
                "lora": 0, "lora_full_ac": 0}
    no_host = replace(DEFAULT_TIMING, dispatch_s=0.0, sac_dispatch_s=0.0, ckpt_dispatch_s=0.0, micro_batch_s=0.0,
                      overlap_loss=0.0)
    host_bound = replace(no_host, bnb4_call_s=1.0)
    gpu_only = replace(no_host, bnb4_call_s=0.0)
    for name, calls in expected.items():
        s = CONFIGS[name].replace(checkpointing=full_ac) if name.endswith("full_ac") else CONFIGS[name]
        est = memopt.estimate(prof, s, exact_reserved=False, timing=host_bound)
        d = est.detail
        t = d["time_terms"]
        assert t["forward"]["bnb4_calls"] + t["backward"]["bnb4_calls"] == calls, name
        assert d["time_terms"]["micro_batches"] == m
        gpu_s = d["forward_s"] + d["backward_s"]  # both already x m
        plain = memopt.estimate(prof, s, exact_reserved=False, timing=gpu_only)
        assert plain.step_time_s == pytest.approx(gpu_s + d["optimizer_s"], rel=1e-12), name
        if calls:
            # 1 s a call dwarfs the tiny model's GPU time: exactly m x calls x 1 s, plus the optimizer step
            assert est.step_time_s == pytest.approx(m * calls * 1.0 + d["optimizer_s"], rel=1e-12), name
            default = memopt.estimate(prof, s, exact_reserved=False)
            # each micro-batch after the first adds into the kept gradients: one op per gradient, spread over passes
            accumulate_ops = (m - 1) / m * t["accumulate"]["launches"]
            host_s = m * (calls * DEFAULT_TIMING.bnb4_call_s + DEFAULT_TIMING.micro_batch_s
                          + (t["forward"]["launches"] + t["backward"]["launches"] + accumulate_ops)
                          * DEFAULT_TIMING.dispatch_s + t["forward"]["ckpt_ops"] * DEFAULT_TIMING.ckpt_dispatch_s)
            assert default.detail["host_s"] == pytest.approx(host_s, rel=1e-12), name
            dgpu = default.detail["forward_s"] + default.detail["backward_s"]
            assert default.step_time_s == pytest.approx(
                max(dgpu, host_s) + DEFAULT_TIMING.overlap_loss * min(dgpu, host_s) + default.detail["optimizer_s"],
                rel=1e-12), name
        else:
            assert est.step_time_s == plain.step_time_s, name  # LoRA on the bf16 base: no bitsandbytes call


def test_bnb4_call_s_is_the_measured_h200_figure():
    """``TimingModel.bnb4_call_s`` is benchmarks/quant/raw/dequant_h200.json's mean 4-bit forward + backward time over
    its two dequantizing calls (see the field's comment)."""
    from pathlib import Path

    from memopt.estimate.timing import DEFAULT_TIMING

    rows = json.loads((Path(__file__).resolve().parents[2] / "benchmarks/quant/raw/dequant_h200.json").read_text())
    nf4 = [r["nf4_fwd_bwd_s"] for r in rows["rows"]]
    assert DEFAULT_TIMING.bnb4_call_s == pytest.approx(sum(nf4) / len(nf4) / 2, rel=0.01)
