"""A model whose forward reads its token ids' values (a vision-language model finds its image placeholders among
them) is traced with the real batch's ids and masks, rows in turn, not with stand-in values."""

from __future__ import annotations

import copy

import pytest
import torch

import memopt
from tests.reference_loop import losses_of_plain_loop

transformers = pytest.importorskip("transformers")


def _llava():
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, image_size=16, patch_size=8)
    text = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    return transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=5, vision_feature_select_strategy="default"))


def _batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 128, (4, 12), generator=g)
    ids[:, 1:5] = 5  # four image placeholders per row: the four patch features of a 16x16 image
    labels = ids.clone()
    labels[:, :5] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": torch.randn(4, 3, 16, 16,
                                                                                                 generator=g),
            "labels": labels}


def test_a_vision_language_model_plans_and_trains_as_the_plain_loop():
    """Traced with every id the batch's largest, the model found no image token and raised out of wrap."""
    model = _llava()
    ref = copy.deepcopy(model)
    batches = [_batch(seed) for seed in range(2)]
    # SGD: Adam would magnify the fp32 noise of near-zero gradients
    want = losses_of_plain_loop(ref, batches, lambda m, b: m(**b).loss,
                                torch.optim.SGD(ref.parameters(), lr=0.1))
    wrapped = memopt.wrap(model, budget="16GB", hardware="h100_80gb", sample=batches[0], device="cpu", guard=False,
                          use_cache=False, optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                          pins={"precision": "fp32"})
    got = [wrapped.step(b) for b in batches]
    assert got == pytest.approx(want, rel=1e-5)
    for p, q in zip(wrapped.model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
