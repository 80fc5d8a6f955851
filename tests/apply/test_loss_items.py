"""Which items a model's loss counts is measured, not read off its class (memopt.step.loss_items): XLNet's LM head is
in transformers' causal-LM mapping but does not shift its labels, BLIP's captioning head is outside it and does, and
a batch's own ``num_items_in_batch`` makes each micro-batch's loss a share of the whole batch's. Each trains through
micro-batches exactly as the unwrapped loop over whole batches."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import memopt
from memopt.step.loss_items import measure_label_shift
from tests.reference_loop import losses_of_plain_loop

transformers = pytest.importorskip("transformers")


def _xlnet() -> nn.Module:
    return transformers.XLNetLMHeadModel(transformers.XLNetConfig(vocab_size=64, d_model=32, n_layer=2, n_head=2,
                                                                  d_inner=64, dropout=0.0))


def _blip() -> nn.Module:
    text = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                encoder_hidden_size=32)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=16,
                  patch_size=8)
    return transformers.BlipForConditionalGeneration(
        transformers.BlipConfig(text_config=text, vision_config=vision, projection_dim=16))


def _llama() -> nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16))


def _tokens(seed: int, masked: bool, length: int = 10) -> dict[str, torch.Tensor]:
    """Four rows; with ``masked`` rows 1 and 3 carry far fewer labels than 0 and 2, so the two micro-batches of 2
    weigh differently by shifted and by unshifted counts."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 64, (4, length), generator=g)
    labels = ids.clone()
    if masked:
        labels[1, 2:] = -100
        labels[3, 3:] = -100
    return {"input_ids": ids, "labels": labels}


def _captions(seed: int, masked: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + seed)
    return {"pixel_values": torch.randn(4, 3, 16, 16, generator=g), **_tokens(seed, masked, length=8)}


def _assert_trains_as_unwrapped(build: Callable[[], nn.Module], batches: list[dict[str, Any]]) -> None:
    torch.manual_seed(0)
    model = build()
    ref = copy.deepcopy(model)
    wrapped = memopt.wrap(model, budget="4GB", sample=batches[0], hardware="h100_80gb", device="cpu",
                          use_cache=False, guard=False,
                          pins={"micro_batch_size": 2, "precision": "fp32", "checkpointing": "none"},
                          optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5))
    got = [wrapped.step(dict(b)) for b in batches]
    want = losses_of_plain_loop(ref, batches, lambda m, b: m(**b).loss, torch.optim.SGD(ref.parameters(), lr=0.5))
    assert got == pytest.approx(want, rel=1e-5)
    for p, q in zip(wrapped.model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_the_shift_is_measured_from_which_label_positions_carry_loss():
    torch.manual_seed(0)
    kw = dict(loss_fn=None, precision="fp32", device_type="cpu")
    assert measure_label_shift(_llama(), _tokens(0, True), **kw) is True
    assert measure_label_shift(_xlnet(), _tokens(0, True), **kw) is False  # in the causal-LM mapping, unshifted
    assert measure_label_shift(_blip(), _captions(0, True), **kw) is True  # outside it, shifted


def test_xlnet_whose_loss_does_not_shift_is_weighted_by_every_label():
    """Weighted by labels shifted by one (the class is in transformers' causal-LM mapping), the micro-batches were
    weighted 11:14 where the loss's own weights are 13:16."""
    _assert_trains_as_unwrapped(_xlnet, [_tokens(i, masked=True) for i in range(3)])


@pytest.mark.parametrize("first_masked", [True, False], ids=["masked_first", "unmasked_first"])
def test_blip_captioning_that_shifts_its_labels_is_weighted_by_the_shifted_ones(first_masked):
    """Counted unshifted, a masked first batch was refused as a mean over a mask, and an unmasked one (every
    weighting equal) let the masked batches after it be weighted wrongly."""
    _assert_trains_as_unwrapped(_blip, [_captions(0, first_masked), _captions(1, True), _captions(2, True)])


@pytest.mark.parametrize("as_tensor", [False, True], ids=["int", "tensor"])
def test_a_batch_with_num_items_in_batch_trains_as_the_whole_batch(as_tensor):
    """The model divides each micro-batch's summed loss by the whole batch's count: the shares are added, not
    weighted again as means (which halved the loss and skewed the gradient)."""
    batches = []
    for i in range(3):
        b = _tokens(i, masked=True)
        n = int((b["labels"][:, 1:] != -100).sum())
        b["num_items_in_batch"] = torch.tensor(n) if as_tensor else n
        batches.append(b)
    _assert_trains_as_unwrapped(_llama, batches)
