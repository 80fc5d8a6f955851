"""The optimizer step extrapolated from shallow copies of the parameter list equals the step traced in full."""

import dataclasses

import pytest

import memopt
from memopt.hardware import load_hardware
from memopt.models import build_model, with_overrides
from memopt.profile.cuda_semantics import kernel_policy_for
from memopt.profile.optimizer_scaling import (
    SHALLOW_BLOCKS,
    canonical_events,
    extrapolate_optimizer,
    model_layout,
    scaled_optimizer_trace,
    trainable_params,
)
from memopt.profile.optimizer_trace import OptimizerTrace, trace_optimizer
from memopt.profile.variant_trace import variant_key
from memopt.techniques.adapters import AdapterSetting, peft_installed
from memopt.techniques.precision import weight_dtype
from memopt.techniques.quantization import with_extra

HW = load_hardware("h100_80gb")
POLICY = kernel_policy_for(HW)
DEPTH = 9


@pytest.fixture(scope="module")
def model():
    return build_model(with_overrides("tiny_llama", {"num_hidden_layers": DEPTH}), device="meta")


def _same_step(a: OptimizerTrace, b: OptimizerTrace) -> None:
    """Equal up to the names of the keys: events (with which are states), scalars, cost."""
    def seq(t: OptimizerTrace) -> list[tuple[int, ...]]:
        return canonical_events([(k, key, size, key in t.state_keys) for k, key, size in t.first] + [(0, 0, 0)]
                                + list(t.steady))

    assert seq(a) == seq(b)
    assert (a.state_bytes, a.master_bytes, a.host_state_bytes) == (b.state_bytes, b.master_bytes, b.host_state_bytes)
    assert a.cost.to_dict() == b.cost.to_dict()
    assert (a.precision, a.optimizer, a.extras) == (b.precision, b.optimizer, b.extras)


CASES = [("fp32", "adamw_fused"), ("fp32", "adamw_foreach"), ("fp32", "adamw"), ("fp32", "sgd"),
         ("fp16_autocast", "adamw_fused"), ("fp16_autocast", "adamw_foreach"), ("bf16_master", "adamw_fused"),
         ("bf16_master", "adamw_foreach"), ("bf16_pure", "adamw_foreach"), ("fp32", "adamw8bit"),
         ("fp32", "paged_adamw8bit")]


@pytest.mark.parametrize(("precision", "optimizer"), CASES)
def test_the_extrapolated_step_equals_the_full_trace(model, precision, optimizer):
    layout = model_layout(model, weight_dtype(precision))
    assert layout is not None

    def trace(params):
        return trace_optimizer(None, precision, optimizer, POLICY, params=params)

    shallow = [trace(trainable_params(*layout[:2], [k])) for k in SHALLOW_BLOCKS]
    extrapolated = extrapolate_optimizer(shallow, DEPTH - SHALLOW_BLOCKS[0])
    assert extrapolated is not None  # the shallow traces agree: no fallback to the full trace
    _same_step(extrapolated, trace_optimizer(model, precision, optimizer, POLICY))


def test_a_copy_that_breaks_the_pattern_falls_back_to_the_full_trace(model):
    layout = model_layout(model, weight_dtype("fp32"))
    calls = []

    def trace(params):
        calls.append(len(params))
        full = trace_optimizer(None, "fp32", "adamw_fused", POLICY, params=params)
        if len(calls) == 3:  # the 6-block copy does something the 4- and 5-block ones do not predict
            full.state_bytes += 512
        return full

    out = scaled_optimizer_trace(*layout, trace)
    assert len(calls) == 4 and calls[-1] == len(trainable_params(*layout))
    _same_step(out, trace_optimizer(model, "fp32", "adamw_fused", POLICY))


def test_a_shallow_model_is_traced_in_full():
    shallow = build_model(with_overrides("tiny_llama", {"num_hidden_layers": 4}), device="meta")
    assert model_layout(shallow, weight_dtype("fp32")) is None


@pytest.mark.skipif(not peft_installed(), reason="adapters need peft")
def test_the_profile_steps_adapters_through_the_extrapolation():
    """With extras the trained parameters are the variant's own (LoRA): extrapolated == traced over all of them."""
    spec = with_overrides("tiny_llama", {"num_hidden_layers": DEPTH})
    prof = memopt.profile(spec, sample={"batch_size": 1, "seq_len": 32}, hardware=HW, use_cache=False)
    strategy = with_extra(memopt.Strategy(precision="bf16_autocast", optimizer="adamw_foreach"), "adapters",
                          AdapterSetting(r=8, alpha=16))
    variant = prof.variant(variant_key(strategy), 1)
    fast = prof.optimizer("bf16_autocast", "adamw_foreach", variant)
    params, _ = prof.model_state(variant)
    full = trace_optimizer(None, "bf16_autocast", "adamw_foreach", POLICY,
                           params=[(shape, dtype) for shape, dtype, grad in params if grad])
    _same_step(fast, dataclasses.replace(full, extras=fast.extras))
