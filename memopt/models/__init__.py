"""Model architectures as specs (``configs/model/*.yaml``), built from config on any device, and their samples.

>>> spec = load_model_spec("llama3_8b")
>>> model = build_model(spec)                       # meta device: shapes only, built in well under a second
>>> sample = SampleSpec.parse({"batch_size": 2, "seq_len": 1024}, spec)
>>> batch = make_batch(spec, sample, device="meta")  # input_ids + labels; model(**batch).loss works
"""

from memopt.models.build import ATTN_IMPLEMENTATIONS, build_model, hf_config, with_overrides
from memopt.models.sample import BATCH_KEYS, SampleSpec, expected_token_count, make_batch, token_count
from memopt.models.spec import FAMILIES, SAMPLE_KEYS, ModelSpec, load_model_spec, model_names

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "BATCH_KEYS",
    "FAMILIES",
    "SAMPLE_KEYS",
    "ModelSpec",
    "SampleSpec",
    "build_model",
    "expected_token_count",
    "hf_config",
    "load_model_spec",
    "make_batch",
    "model_names",
    "token_count",
    "with_overrides",
]
