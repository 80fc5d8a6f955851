"""Image models train at the resolution of their batches where their architecture allows it: a ConvNeXt (no position
embeddings) on images smaller than its config's image_size, rectangular images on a ViT whose config's image_size is
a (height, width) pair or on a ConvNeXt, exactly as the unwrapped loop; a ViT fed another size than its position
embeddings were made for is still refused, in one line."""

from __future__ import annotations

import copy

import pytest
import torch

import memopt
from tests.reference_loop import losses_of_plain_loop

transformers = pytest.importorskip("transformers")

B = 4


def _convnext():
    torch.manual_seed(0)
    return transformers.ConvNextForImageClassification(transformers.ConvNextConfig(
        num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3, drop_path_rate=0.0))  # image_size 224


def _vit(image_size):
    torch.manual_seed(0)
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=image_size, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3))


def _batches(height: int, width: int, n: int = 3) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"pixel_values": torch.randn(B, 3, height, width, generator=g),
             "labels": torch.randint(0, 3, (B,), generator=g)} for _ in range(n)]


@pytest.mark.parametrize(("make", "height", "width"), [(_convnext, 32, 32), (_convnext, 32, 48),
                                                       (lambda: _vit((16, 32)), 16, 32)],
                         ids=["convnext smaller", "convnext rectangular", "vit rectangular"])
def test_an_image_model_trains_at_its_batches_resolution_as_the_plain_loop(make, height, width):
    model = make()
    batches = _batches(height, width)
    ref = copy.deepcopy(model)
    # SGD: Adam would magnify the fp32 noise of near-zero gradients
    want = losses_of_plain_loop(ref, batches, lambda m, b: m(**b).loss,
                                torch.optim.SGD(ref.parameters(), lr=0.1))
    w = memopt.wrap(model, budget="4GB", sample=batches[0], hardware="h100_80gb", device="cpu", use_cache=False,
                    guard=False, optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                    pins={"micro_batch_size": 2, "precision": "fp32"})
    got = [w.step(b) for b in batches]
    size = w.plan.model["sample"]["image_size"]
    assert (size if isinstance(size, int) else list(size)) == (height if height == width else [height, width])
    assert got == pytest.approx(want, rel=1e-5)
    for name, value in ref.named_parameters():
        torch.testing.assert_close(model.get_parameter(name), value, rtol=1e-5, atol=1e-6, msg=name)


def test_a_model_whose_position_embeddings_fix_the_resolution_is_refused_another():
    for model, batch in ((_vit(16), _batches(32, 32, 1)[0]), (_vit(16), _batches(16, 32, 1)[0]),
                         (_vit((16, 32)), _batches(32, 16, 1)[0])):
        with pytest.raises(ValueError, match=r"differs from 'ViTForImageClassification''s image_size .*its position "
                           "embeddings fix the resolution"):
            memopt.wrap(model, budget="4GB", sample=batch, hardware="h100_80gb")
