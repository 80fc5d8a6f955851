"""The GPU validation matrices (which rows ``scripts/validate_gpu.py`` measures).

``estimator``: the foundation issue's matrix: >= 6 architectures (a mixture-of-experts model and
dropout models among them) x 3 configurations (bf16 autocast + fused AdamW; full checkpointing; 8-bit
AdamW states) at realistic shapes (sequence >= 1024 for language models, peaks >= 10 GiB), plus every
other technique the planner can choose (selective checkpointing, activation offload, SDPA backends,
chunked cross-entropy, fp32/fp16/bf16 precision variants, micro-batching, the default allocator).
"""

from __future__ import annotations

from harness.rows import Row
from memopt.strategy import Checkpointing, Strategy

__all__ = ["MATRICES", "matrix"]

_BF16 = Strategy(precision="bf16_autocast", optimizer="adamw_fused")
_FULL_AC = _BF16.replace(checkpointing=Checkpointing(mode="full"))
_ADAM8 = _BF16.replace(optimizer="adamw8bit")

# model name, sample, config overrides; chosen so the default configuration peaks well above 10 GiB on an H200
_MODELS: list[tuple[str, dict, dict]] = [
    ("llama32_1b", {"batch_size": 4, "seq_len": 2048}, {}),
    ("qwen25_0_5b", {"batch_size": 8, "seq_len": 2048}, {}),
    ("gpt2_medium", {"batch_size": 16, "seq_len": 1024}, {}),
    ("bert_large", {"batch_size": 16, "seq_len": 1024}, {"max_position_embeddings": 1024}),
    ("vit_large", {"batch_size": 64, "image_size": 224}, {}),
    ("t5_base", {"batch_size": 16, "seq_len": 1024}, {}),
    ("qwen2_moe_small", {"batch_size": 4, "seq_len": 2048}, {}),
]


def _row(model: str, sample: dict, overrides: dict, name: str, strategy: Strategy, **kw: object) -> Row:
    return Row(id=f"{model}/{name}", model=model, overrides=overrides, strategy=strategy, **sample, **kw)


def _estimator_matrix() -> list[Row]:
    rows: list[Row] = []
    for model, sample, overrides in _MODELS:
        rows.append(_row(model, sample, overrides, "bf16+fused_adamw", _BF16, tags=("core",)))
        rows.append(_row(model, sample, overrides, "full_ac", _FULL_AC, tags=("core",)))
        rows.append(_row(model, sample, overrides, "adamw8bit", _ADAM8, tags=("core",)))
    llama, lsample, lover = _MODELS[0]
    gpt, gsample, gover = _MODELS[2]
    qwen, qsample, qover = _MODELS[1]
    extra = [
        (llama, lsample, lover, "selective_ac", _BF16.replace(checkpointing=Checkpointing(mode="selective"))),
        (llama, lsample, lover, "half_full_ac", _BF16.replace(checkpointing=Checkpointing(mode="full", num_blocks=8))),
        (llama, lsample, lover, "fp32", _BF16.replace(precision="fp32")),
        (llama, lsample, lover, "fp16", _BF16.replace(precision="fp16_autocast")),
        (llama, lsample, lover, "bf16_master", _BF16.replace(precision="bf16_master")),
        (llama, lsample, lover, "bf16_pure", _BF16.replace(precision="bf16_pure")),
        (llama, lsample, lover, "chunked_ce", _BF16.replace(chunked_ce=8)),
        (llama, lsample, lover, "act_offload", _BF16.replace(activation_offload=True)),
        (llama, lsample, lover, "attn_efficient", _BF16.replace(attention="efficient")),
        (llama, lsample, lover, "attn_math", _BF16.replace(attention="math", micro_batch_size=1, grad_accum_steps=4)),
        (llama, lsample, lover, "accum_2x2", _BF16.replace(micro_batch_size=2, grad_accum_steps=2)),
        (llama, lsample, lover, "default_allocator", _BF16.replace(expandable_segments=False)),
        (llama, lsample, lover, "paged_adamw8bit", _BF16.replace(optimizer="paged_adamw8bit")),
        (gpt, gsample, gover, "selective_ac", _BF16.replace(checkpointing=Checkpointing(mode="selective"))),
        (gpt, gsample, gover, "fp16", _BF16.replace(precision="fp16_autocast")),
        (gpt, gsample, gover, "default_allocator", _BF16.replace(expandable_segments=False)),
        (qwen, qsample, qover, "chunked_ce", _BF16.replace(chunked_ce=8)),
        (qwen, qsample, qover, "act_offload_full_ac", _FULL_AC.replace(activation_offload=True)),
        (qwen, qsample, qover, "adamw_foreach", _BF16.replace(optimizer="adamw_foreach")),
    ]
    for model, sample, overrides, name, strategy in extra:
        rows.append(_row(model, sample, overrides, name, strategy, tags=("technique",)))
    # the global batch for rows that accumulate: micro_batch_size x grad_accum_steps must equal batch_size
    fixed = []
    for r in rows:
        s = r.strategy
        if s.grad_accum_steps == 1:
            s = s.replace(micro_batch_size=r.batch_size)
        fixed.append(Row(**{**r.__dict__, "strategy": s}))
    return fixed


MATRICES = {"estimator": _estimator_matrix}


def matrix(name: str) -> list[Row]:
    if name not in MATRICES:
        raise ValueError(f"unknown matrix {name!r}; known: {sorted(MATRICES)}")
    return MATRICES[name]()
