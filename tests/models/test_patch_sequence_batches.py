"""An image classifier that reads images as sequences of flattened patches with their grid (SigLIP 2's NaFlex) gets
batches of that shape from a shape sample: memopt plans it and its wrapped step equals an unwrapped one."""

from __future__ import annotations

import torch

from memopt.models import SampleSpec, make_batch
from memopt.profile.batch_factories import spec_from_module
from tests.zoo.mapping_zoo import build, check_pair


def test_a_naflex_image_batch_is_flattened_patches_with_their_grid():
    model = build("image_classification:siglip2")
    vision = model.config.vision_config
    spec = spec_from_module(model)
    batch = make_batch(spec, SampleSpec.parse({"batch_size": 2, "image_size": 64}, spec),
                       generator=torch.Generator().manual_seed(0), config=model.config)
    grid = 64 // vision.patch_size
    assert batch["pixel_values"].shape == (2, grid * grid, vision.num_channels * vision.patch_size ** 2)
    assert batch["spatial_shapes"].tolist() == [[grid, grid]] * 2
    assert float(model(**batch).loss) > 0


def test_a_naflex_image_classifier_is_planned_and_steps_exactly():
    check_pair("image_classification:siglip2")
