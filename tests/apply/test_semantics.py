"""Techniques that must not change training: checked step by step on a CPU, deterministically."""

import pytest
import torch

from memopt.models import SampleSpec, build_model, make_batch
from memopt.step.prepare import prepare
from memopt.strategy import Checkpointing, Strategy

STEPS = 20


def _losses(model_name: str, strategy: Strategy, batches, seed: int = 0) -> list[float]:
    torch.manual_seed(seed)
    model = build_model(model_name, device="cpu")
    prepared = prepare(model, strategy, device_type="cpu", optimizer_kwargs={"lr": 1e-3})
    torch.manual_seed(seed + 1)  # the same dropout masks in every run
    losses = [prepared.step.step(b) for b in batches]
    prepared.undo()
    return losses


@pytest.fixture(scope="module")
def deterministic():
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(previous)


def _batches(model_name: str, n: int = STEPS, batch: int = 4):
    g = torch.Generator().manual_seed(123)
    sample = SampleSpec.parse({"batch_size": batch, "seq_len": 32}, model_name)
    return [make_batch(model_name, sample, generator=g) for _ in range(n)]


@pytest.mark.parametrize("model_name", ["tiny_llama", "tiny_gpt2"])  # gpt2 has dropout
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_is_bitwise_identical(deterministic, model_name, mode):
    batches = _batches(model_name)
    base = Strategy(precision="fp32", optimizer="adamw", micro_batch_size=4)
    plain = _losses(model_name, base, batches)
    ckpt = _losses(model_name, base.replace(checkpointing=Checkpointing(mode=mode)), batches)
    assert plain == ckpt


def test_micro_batching_matches_the_whole_batch(deterministic):
    batches = _batches("tiny_llama", batch=8)
    whole = _losses("tiny_llama", Strategy(precision="fp32", optimizer="adamw", micro_batch_size=8), batches)
    split = _losses("tiny_llama", Strategy(precision="fp32", optimizer="adamw", micro_batch_size=2,
                                            grad_accum_steps=4), batches)
    for a, b in zip(whole, split):
        assert abs(a - b) <= 1e-6 * abs(a)


def test_token_weighted_accumulation_with_uneven_padding(deterministic):
    """Micro-batches with different numbers of loss tokens: the accumulated gradient is the whole batch's."""
    batches = _batches("tiny_llama", n=5, batch=4)
    for b in batches:
        b["labels"][0, :20] = -100  # the first sample carries far fewer tokens
    whole = _losses("tiny_llama", Strategy(precision="fp32", optimizer="sgd", micro_batch_size=4), batches)
    split = _losses("tiny_llama", Strategy(precision="fp32", optimizer="sgd", micro_batch_size=1,
                                            grad_accum_steps=4), batches)
    for a, b in zip(whole, split):
        assert abs(a - b) <= 1e-6 * abs(a)


def test_bf16_autocast_tracks_fp32_within_one_percent(deterministic):
    batches = _batches("tiny_llama")
    fp32 = _losses("tiny_llama", Strategy(precision="fp32", optimizer="adamw", micro_batch_size=4), batches)
    bf16 = _losses("tiny_llama", Strategy(precision="bf16_autocast", optimizer="adamw", micro_batch_size=4), batches)
    for a, b in zip(fp32, bf16):
        assert abs(a - b) <= 0.01 * abs(a)


def test_chunked_cross_entropy_is_exact(deterministic):
    batches = _batches("tiny_llama", n=5)
    plain = _losses("tiny_llama", Strategy(precision="fp32", optimizer="sgd", micro_batch_size=4), batches)
    chunked = _losses("tiny_llama", Strategy(precision="fp32", optimizer="sgd", micro_batch_size=4, chunked_ce=3),
                      batches)
    for a, b in zip(plain, chunked):
        assert abs(a - b) <= 1e-5 * abs(a)


def test_activation_offload_changes_no_number_on_cpu(deterministic):
    batches = _batches("tiny_llama", n=5)
    base = Strategy(precision="fp32", optimizer="adamw", micro_batch_size=4)
    assert _losses("tiny_llama", base, batches) == _losses("tiny_llama", base.replace(activation_offload=True), batches)
