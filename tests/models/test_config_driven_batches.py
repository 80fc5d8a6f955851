"""Families whose batches ``make_batch`` shapes by their config: the speech LLMs of the seq2seq mapping (no
encoder-decoder: causal-LM labels), CANINE (hashed ids, no vocabulary), ImageGPT (images as token ids), BROS (word
boxes) and X-MOD (a language id). Each batch makes the tiny model return a loss."""

from __future__ import annotations

import pytest
import torch

from memopt.models import SampleSpec, expected_token_count, make_batch, token_count
from memopt.models.sample import is_decoder_only
from memopt.profile.batch_factories import spec_from_module
from tests.zoo.mapping_zoo import build


def _batch(model, sample):
    spec = spec_from_module(model)
    batch = make_batch(spec, SampleSpec.parse(sample, spec), generator=torch.Generator().manual_seed(0),
                       config=model.config)
    return spec, batch


def test_a_speech_llm_of_the_seq2seq_mapping_gets_causal_lm_labels():
    model = build("seq2seq_lm:qwen2_audio")
    spec, batch = _batch(model, {"batch_size": 2, "seq_len": 12, "decoder_seq_len": 4})
    assert is_decoder_only(spec) and is_decoder_only(spec, model.config)
    assert torch.equal(batch["labels"], batch["input_ids"]) and batch["input_ids"].shape == (2, 12)
    assert token_count(batch, spec) == expected_token_count(spec, {"batch_size": 2, "seq_len": 12}) == 2 * 11
    assert torch.isfinite(model(**batch).loss)
    t5 = spec_from_module(build("seq2seq_lm:t5"))
    assert not is_decoder_only(t5) and not is_decoder_only("tiny_t5")  # encoder-decoders keep decoder labels


@pytest.mark.parametrize(("pair", "extra"), [("sequence_classification:canine", set()),
                                              ("token_classification:bros", {"bbox"}),
                                              ("causal_lm:xmod", {"lang_ids"})])
def test_token_models_get_the_inputs_their_config_asks_for(pair, extra):
    model = build(pair)
    _, batch = _batch(model, {"batch_size": 2, "seq_len": 16})
    assert set(batch) == {"input_ids", "labels"} | extra
    assert torch.isfinite(model(**batch).loss)


def test_an_image_classifier_that_reads_pixels_as_tokens_gets_input_ids():
    model = build("image_classification:imagegpt")
    _, batch = _batch(model, {"batch_size": 2, "image_size": 8})
    assert set(batch) == {"input_ids", "labels"} and batch["input_ids"].shape == (2, 64)
    assert int(batch["input_ids"].max()) < model.config.vocab_size
    assert torch.isfinite(model(**batch).loss)
