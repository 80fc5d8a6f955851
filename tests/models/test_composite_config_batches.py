"""A vision-language model in the causal-LM mapping (Gemma-3's ForConditionalGeneration) keeps its vocabulary in its
text config: memopt samples token batches from it, and plans and steps the model from a shape sample."""

from __future__ import annotations

import torch

from memopt.models import SampleSpec, make_batch
from memopt.profile.batch_factories import spec_from_module
from tests.zoo.mapping_zoo import build


def test_token_batches_of_a_composite_config_use_its_text_vocabulary():
    model = build("causal_lm:gemma3")
    assert getattr(model.config, "vocab_size", None) is None  # the case: only the text config has it
    vocab = model.config.get_text_config().vocab_size
    spec = spec_from_module(model)
    batch = make_batch(spec, SampleSpec.parse({"batch_size": 2, "seq_len": 8}, spec),
                       generator=torch.Generator().manual_seed(0), config=model.config)
    assert batch["input_ids"].shape == (2, 8) and int(batch["input_ids"].max()) < vocab
    assert float(model(**batch).loss) > 0
