"""The composed estimate (4 traced blocks, repeated) against a fake-tensor simulation of the whole model with the
strategy applied for real (not a replay of the traces): allocated peak within 1% — in practice exact."""

import functools

import pytest

import memopt
from memopt.estimate.allocator import simulate_allocator
from memopt.estimate.allocator_config import AllocatorConfig
from memopt.models import SampleSpec, build_model, make_batch, with_overrides
from memopt.profile.cuda_semantics import kernel_policy_for
from memopt.profile.simulate import simulate_step
from memopt.strategy import Checkpointing, Strategy

LAYER_KEY = {"tiny_gpt2": "n_layer", "tiny_t5": "num_layers", "gpt2": "n_layer", "gpt2_medium": "n_layer",
             "gpt2_large": "n_layer", "t5_base": "num_layers", "t5_large": "num_layers"}
BASE = Strategy(precision="bf16_autocast", micro_batch_size=2, grad_accum_steps=2)
CONFIGS = {
    "bf16": BASE,
    "full_ac": BASE.replace(checkpointing=Checkpointing(mode="full")),
    "half_ac": BASE.replace(checkpointing=Checkpointing(mode="full", num_blocks=3)),
    "selective_ac": BASE.replace(checkpointing=Checkpointing(mode="selective")),
    "fp32": BASE.replace(precision="fp32"),
    "bf16_master": BASE.replace(precision="bf16_master"),
    "adamw8bit": BASE.replace(optimizer="adamw8bit"),
    "foreach": BASE.replace(optimizer="adamw_foreach"),
    "offload": BASE.replace(activation_offload=True),
    "mb1": BASE.replace(micro_batch_size=1, grad_accum_steps=4),
}


@functools.cache
def shared_profile(model_name: str, overrides: tuple, sample: tuple, hardware: str) -> memopt.Profile:
    """One cold profile per model and sample, shared by the strategies compared on it: a strategy's estimate reads
    only its own variants' traces, so an estimate from a profile that already holds another's equals a fresh one
    (tests/plan/test_estimate_store.py: a plan from stored estimates equals one computed afresh)."""
    return memopt.profile(with_overrides(model_name, dict(overrides)), sample=dict(sample), hardware=hardware,
                          use_cache=False)


def _compare(model_name: str, overrides: dict, sample: dict, strategy: Strategy, hardware: str = "h200"):
    spec = with_overrides(model_name, overrides)
    prof = shared_profile(model_name, tuple(sorted(overrides.items())), tuple(sorted(sample.items())), hardware)
    est = memopt.estimate(prof, strategy, exact_reserved=True, num_steps=3)
    return (est, *simulate_whole_step(spec, sample, strategy, hardware))


def simulate_whole_step(spec, sample: dict, strategy: Strategy, hardware: str = "h200") -> tuple[int, int]:
    """(allocated peak, reserved peak) of the whole model's steps simulated with the strategy applied."""
    model = build_model(spec, device="meta")
    parsed = SampleSpec.parse(sample, spec)
    sim = simulate_step(model, lambda d: make_batch(spec, parsed, device=d), strategy,
                        policy=kernel_policy_for(memopt.load_hardware(hardware)), num_steps=3)
    events = sim.run.events
    first = next(i for i, e in enumerate(events) if sim.run.phases[e[3]] != "setup")
    alloc = simulate_allocator([e[:3] for e in events[first:]],
                               config=AllocatorConfig(expandable_segments=strategy.expandable_segments),
                               initial_events=[e[:3] for e in events[:first]])
    return sim.peak_allocated_bytes, alloc.peak_reserved_bytes


FAST = {"bf16", "full_ac", "half_ac", "adamw8bit", "offload", "mb1"}


@pytest.mark.parametrize("config", [c if c in FAST else pytest.param(c, marks=pytest.mark.slow)
                                    for c in sorted(CONFIGS)])
def test_composed_matches_simulation_tiny_llama(config):
    est, sim_alloc, _ = _compare("tiny_llama", {"num_hidden_layers": 7}, {"batch_size": 4, "seq_len": 64},
                                            CONFIGS[config])
    assert abs(est.peak_allocated_bytes - sim_alloc) <= 0.01 * sim_alloc
    assert est.peak_reserved_bytes >= est.peak_allocated_bytes


@pytest.mark.parametrize("model", ["tiny_gpt2", "tiny_bert", "tiny_t5", "tiny_vit", "tiny_moe"])
@pytest.mark.parametrize("config", ["bf16", pytest.param("full_ac", marks=pytest.mark.slow)])
def test_composed_matches_simulation_tiny_models(model, config):
    overrides = {LAYER_KEY.get(model, "num_hidden_layers"): 6}
    spec = with_overrides(model, overrides)
    sample = {"batch_size": 4, "seq_len": 64} if spec.is_token_model else {"batch_size": 4}
    est, sim_alloc, _ = _compare(model, overrides, sample, CONFIGS[config])
    assert abs(est.peak_allocated_bytes - sim_alloc) <= 0.01 * sim_alloc


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama3_8b", "qwen2_7b", "mistral_7b", "gpt2_medium", "bert_large", "t5_base",
                                   "vit_large", "qwen2_moe_a2_7b", "llama3_70b"])
@pytest.mark.parametrize("config", ["bf16", "half_ac", "selective_ac", "adamw8bit"])
def test_composed_matches_simulation_shipped_configs(model, config):
    """Every shipped architecture at its real width (6 blocks, short sequences to keep CI's CPU time down)."""
    overrides = {LAYER_KEY.get(model, "num_hidden_layers"): 6}
    spec = with_overrides(model, overrides)
    sample = {"batch_size": 4, "seq_len": 128} if spec.is_token_model else {"batch_size": 4}
    est, sim_alloc, _ = _compare(model, overrides, sample, CONFIGS[config])
    assert abs(est.peak_allocated_bytes - sim_alloc) <= 0.01 * sim_alloc
