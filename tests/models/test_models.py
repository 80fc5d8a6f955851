"""Shipped model specs, building from config (meta and CPU), samples and random batches."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch
import yaml
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from memopt.models import (
    SampleSpec,
    build_model,
    expected_token_count,
    hf_config,
    load_model_spec,
    make_batch,
    model_names,
    token_count,
)

REQUIRED = [
    "llama3_8b", "llama3_70b", "llama3_405b", "llama32_1b", "llama32_3b", "qwen2_7b", "qwen2_1_5b", "qwen25_0_5b",
    "mistral_7b", "gpt2", "gpt2_medium", "gpt2_large", "bert_base", "bert_large", "t5_base", "t5_large", "vit_base",
    "vit_large", "qwen2_moe_a2_7b", "qwen2_moe_small",
]  # fmt: skip
TINY = ["tiny_llama", "tiny_gpt2", "tiny_bert", "tiny_t5", "tiny_vit", "tiny_moe"]

# Published parameter counts (model cards / papers; MLM and classification heads included).
PUBLISHED_PARAMS = {
    "llama3_8b": 8.03e9,
    "llama3_70b": 70.6e9,
    "llama3_405b": 405.9e9,
    "llama32_1b": 1.24e9,
    "llama32_3b": 3.21e9,
    "qwen2_7b": 7.6e9,
    "qwen2_1_5b": 1.54e9,
    "qwen25_0_5b": 0.494e9,
    "qwen2_moe_a2_7b": 14.3e9,
    "mistral_7b": 7.24e9,
    "gpt2": 124e6,
    "gpt2_medium": 355e6,
    "gpt2_large": 774e6,
    "bert_base": 110e6,
    "t5_base": 223e6,
    "vit_base": 86e6,
}


def _params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() counts tied weights once


def test_required_models_are_shipped():
    names = model_names()
    assert not [n for n in REQUIRED + TINY if n not in names]


@pytest.mark.parametrize("name", model_names())
def test_shipped_spec_loads_and_builds_small_on_meta(name):
    spec = load_model_spec(name)
    assert spec.name == name and spec.path is not None and spec.path.name == f"{name}.yaml"
    raw = spec.path.read_text()
    assert raw.lstrip().startswith("#"), "each shipped model YAML starts with a provenance comment"
    assert set(yaml.safe_load(raw)) == {"name", "family", "architecture", "hf_config", "sample"}
    model = build_model(spec, overrides={"num_hidden_layers": 2})
    assert type(model).__name__ == spec.architecture
    assert model.training
    assert {p.device.type for p in model.parameters()} == {"meta"}
    sample = SampleSpec.parse(None, spec)
    batch = make_batch(spec, sample, device="meta")
    assert "attention_mask" not in batch and "labels" in batch
    if spec.is_token_model:
        assert batch["input_ids"].shape == (sample.batch_size, sample.seq_len)
        assert sample.tokens_per_sample == sample.seq_len
    else:
        assert batch["pixel_values"].shape[-1] == sample.image_size and sample.tokens_per_sample is None
    if name.startswith("tiny_"):
        assert _params(build_model(spec)) < 1_000_000


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_full_size_param_count_matches_published(name):
    count = _params(build_model(name))
    assert math.isclose(count, PUBLISHED_PARAMS[name], rel_tol=0.01), f"{name}: {count:,}"


def test_moe_small_is_a_few_hundred_million_params():
    assert 200e6 < _params(build_model("qwen2_moe_small")) < 600e6


def test_meta_build_of_70b_is_fast():
    build_model("tiny_llama")  # import transformers' modeling code outside the timing
    start = time.perf_counter()
    model = build_model("llama3_70b", dtype=torch.bfloat16)
    elapsed = time.perf_counter() - start
    assert next(model.parameters()).dtype == torch.bfloat16
    assert elapsed < 10, f"meta build of llama3_70b took {elapsed:.1f}s"


@pytest.mark.parametrize("name", TINY)
def test_tiny_model_trains_one_cpu_step(name):
    torch.manual_seed(0)
    spec = load_model_spec(name)
    model = build_model(spec, device="cpu")
    batch = make_batch(spec, None, generator=torch.Generator().manual_seed(0))
    out = model(**batch)
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"parameters without gradient: {missing}"
    assert token_count(batch, spec) == expected_token_count(spec, None) > 0


@pytest.mark.parametrize("name", TINY)
def test_make_batch_and_training_step_under_fake_tensor_mode(name):
    spec = load_model_spec(name)
    # transformers' grouped_mm experts kernel is bf16-only under fake/meta tensors (real CPU runs fp32 too).
    dtype = torch.bfloat16 if spec.model_type == "qwen2_moe" else torch.float32
    with FakeTensorMode():
        model = build_model(spec, device="cpu", dtype=dtype)
        batch = make_batch(spec, {"batch_size": 2})
        assert all(isinstance(t, FakeTensor) for t in batch.values())
        loss = model(**batch).loss
        loss.backward()
    assert isinstance(loss, FakeTensor)
    assert _params(model) == _params(build_model(spec))  # weights stay tied although init is skipped


def test_make_batch_contents():
    g = torch.Generator().manual_seed(1)
    causal = make_batch("tiny_llama", {"batch_size": 3, "seq_len": 20}, generator=g)
    assert causal["input_ids"].dtype == torch.long and int(causal["input_ids"].max()) < 256
    assert torch.equal(causal["labels"], causal["input_ids"])
    assert token_count(causal, "tiny_llama") == 3 * 19 and token_count(causal) == 60

    mlm = make_batch("tiny_bert", {"batch_size": 4, "seq_len": 20}, generator=g)
    labelled = mlm["labels"] != -100
    assert labelled.sum(dim=1).tolist() == [3, 3, 3, 3]  # round(0.15 * 20) per row
    assert torch.equal(mlm["labels"][labelled], mlm["input_ids"][labelled])
    assert token_count(mlm, "tiny_bert") == expected_token_count("tiny_bert", {"batch_size": 4, "seq_len": 20}) == 12

    s2s = make_batch("tiny_t5", {"batch_size": 2, "seq_len": 24, "decoder_seq_len": 8}, generator=g)
    assert s2s["input_ids"].shape == (2, 24) and s2s["labels"].shape == (2, 8)
    assert token_count(s2s, "tiny_t5") == 16

    img = make_batch("tiny_vit", {"batch_size": 5}, generator=g)
    assert img["pixel_values"].shape == (5, 3, 32, 32) and img["pixel_values"].dtype == torch.float32
    assert img["labels"].shape == (5,) and int(img["labels"].max()) < 10
    assert token_count(img) == token_count(img, "tiny_vit") == 5


def test_sample_parse_shapes_and_model_sample():
    spec = load_model_spec("t5_base")
    assert SampleSpec.parse(None, spec) == SampleSpec(batch_size=8, seq_len=512, decoder_seq_len=128)
    # missing keys come from the spec's sample
    assert SampleSpec.parse({"batch_size": 2}, "llama3_8b") == SampleSpec(batch_size=2, seq_len=4096)
    sample = SampleSpec.parse({"batch_size": 2, "seq_len": 64})
    assert sample.tokens_per_sample == 64 and sample.decoder_len == 64 and not sample.variable_length
    assert SampleSpec.parse({"batch_size": 2, "seq_len": 64}, "tiny_t5").decoder_seq_len == 16
    assert SampleSpec.parse(sample.to_dict()) == sample
    assert SampleSpec.parse({"batch_size": 4, "image_size": 224}).tokens_per_sample is None


def test_sample_parse_reports_all_problems_at_once():
    with pytest.raises(ValueError) as err:
        SampleSpec.parse({"batch_size": 0, "seq_len": -5, "seqlen": 4, "image_size": 1.5})
    msg = str(err.value)
    for part in ("seqlen", "valid keys", "batch_size must be a positive int", "seq_len must be a positive int",
                 "image_size must be a positive int", "decoder_seq_len"):  # fmt: skip
        assert part in msg, msg
    with pytest.raises(ValueError) as err:
        SampleSpec.parse({"batch_size": 2, "seq_len": 4096, "image_size": 224}, "gpt2")
    msg = str(err.value)
    assert "image_size does not apply" in msg and "n_positions=1024" in msg
    with pytest.raises(ValueError, match="image_size 384 differs"):
        SampleSpec.parse({"batch_size": 2, "image_size": 384}, "vit_base")
    with pytest.raises(ValueError, match="batch_size is required"):
        SampleSpec(batch_size=None, seq_len=8)  # type: ignore[arg-type]


def test_sample_parse_from_batches():
    ids = torch.zeros(4, 128, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones(4, 128)}
    assert SampleSpec.parse(batch, "tiny_llama") == SampleSpec(batch_size=4, seq_len=128)
    assert SampleSpec.parse(ids) == SampleSpec(batch_size=4, seq_len=128)
    s2s = {"input_ids": ids, "labels": torch.zeros(4, 32, dtype=torch.long)}
    assert SampleSpec.parse(s2s, "tiny_t5").decoder_seq_len == 32
    assert SampleSpec.parse(s2s).decoder_seq_len == 32
    pixels = {"pixel_values": torch.zeros(3, 3, 32, 32), "labels": torch.zeros(3, dtype=torch.long)}
    assert SampleSpec.parse(pixels, "tiny_vit") == SampleSpec(batch_size=3, image_size=32)
    # variable-length: plan for the longest
    ragged = {"input_ids": [torch.zeros(5, dtype=torch.long), [1, 2, 3, 4, 5, 6, 7], [1]]}
    assert SampleSpec.parse(ragged, "tiny_llama") == SampleSpec(batch_size=3, seq_len=7, variable_length=True)
    rows = [{"input_ids": [1, 2]}, {"input_ids": [1, 2, 3, 4]}]
    assert SampleSpec.parse(rows) == SampleSpec(batch_size=2, seq_len=4, variable_length=True)
    with FakeTensorMode():
        fake = {"input_ids": torch.randint(0, 9, (2, 16)), "labels": torch.randint(0, 9, (2, 16))}
        assert SampleSpec.parse(fake, "tiny_gpt2") == SampleSpec(batch_size=2, seq_len=16)
    with pytest.raises(ValueError) as err:
        SampleSpec.parse({"input_ids": ids, "labels": torch.zeros(3, 64), "mask": ids}, "tiny_llama")
    msg = str(err.value)
    assert "mask" in msg and "batch sizes disagree" in msg and "labels has length 64" in msg


def test_unknown_model_name_suggests_closest():
    with pytest.raises(ValueError) as err:
        load_model_spec("llama3-8b")
    msg = str(err.value)
    assert "did you mean 'llama3_8b'" in msg and "tiny_vit" in msg  # lists the shipped names
    with pytest.raises(ValueError, match="did you mean 'num_hidden_layers'"):
        hf_config("gpt2", num_hiden_layers=2)


def test_spec_from_path_and_dict(tmp_path: Path):
    data = yaml.safe_load((load_model_spec("tiny_llama").path).read_text())
    data["name"] = "my_llama"
    path = tmp_path / "my_llama.yaml"
    path.write_text(yaml.safe_dump(data))
    assert load_model_spec(str(path)).name == "my_llama" and load_model_spec(path).path == path.resolve()
    assert load_model_spec(data).hf_config["hidden_size"] == 64
    with pytest.raises(ValueError) as err:
        load_model_spec({"name": "x", "family": "lm", "architecture": "Foo", "hf_config": {}, "extra": 1})
    msg = str(err.value)
    assert "unknown keys ['extra']" in msg and "family 'lm'" in msg and "model_type" in msg
    with pytest.raises(ValueError, match="not a causal_lm model"):
        build_model({**data, "architecture": "BertForMaskedLM"})


def test_hf_config_overrides():
    cfg = hf_config("t5_base", num_hidden_layers=2)
    assert cfg.num_layers == 2 and cfg.num_decoder_layers == 2  # the decoder shrinks with the encoder
    assert hf_config("gpt2", num_hidden_layers=3).n_layer == 3
    assert hf_config("llama3_8b").num_key_value_heads == 8
    assert hf_config("vit_base").num_labels == 1000
    assert hf_config("llama3_405b").rope_parameters["rope_type"] == "llama3"
