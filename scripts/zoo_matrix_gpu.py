#!/usr/bin/env python
"""memopt.wrap on models, shapes and budgets that no config ships, measured under the hard cap on one GPU.

Each row builds a model from a transformers config (or a plain-PyTorch model) at a real size, makes a batch,
calls ``memopt.wrap(model, budget=..., sample=batch)`` exactly as a user would (planning on this machine, fake-CUDA
trace included), trains ``--steps`` steps and records the prediction beside the measurement:

    python scripts/zoo_matrix_gpu.py run --out $OUT/zoo.jsonl [--rows ID,ID] [--width 3] [--deadline-s 540]
    python scripts/zoo_matrix_gpu.py report OLDER.jsonl NEWER.jsonl --out benchmarks/any_model/zoo_h200  # later wins

Each row runs in its own process (an OOM or a crash ends only that row); several rows share the GPU at once when
their budgets fit together (``--width``), so the step times of such a run are not timing data. Fields:
``predicted_peak_allocated_bytes`` / ``measured_peak_allocated_bytes`` (the peak over the steps after the first two,
which hold the autotune), ``first_step_peak_allocated_bytes``, ``measured_total_bytes`` (the brief's total: the reserved
peak of the whole run plus the most memory outside the allocator seen, which is what the driver reports for the
process less what the allocator holds at that moment; ``nvml_max_bytes`` is the driver's figure itself, sampled
between steps, so below the peak where an engine frees cache before a step ends), ``budget_bytes``, ``first_try_oom``
(any out-of-memory error the allocator raised in the process: autotune, guard recovery or step), ``crashed``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class ZooRow:
    id: str
    kind: str  # "causal", "seq2seq", "masked", "seqcls", "tokcls", "image", "torchvision", "custom"
    model_type: str  # a transformers model_type, a torchvision builder, or a custom model's name
    config: dict[str, Any]
    batch_size: int
    seq_len: int = 0
    image_size: int = 224
    budget: str = "24GiB"
    fidelity: str = "default"
    extra: dict[str, Any] = field(default_factory=dict)


def _llm(id: str, model_type: str, cfg: dict, b: int, s: int, budget: str, **kw: Any) -> ZooRow:
    return ZooRow(id, "causal", model_type, cfg, b, s, budget=budget, **kw)


TINYLLAMA = dict(hidden_size=2048, num_hidden_layers=22, intermediate_size=5632, num_attention_heads=32,
                 num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096)
PYTHIA410 = dict(hidden_size=1024, num_hidden_layers=24, intermediate_size=4096, num_attention_heads=16,
                 vocab_size=50304, max_position_embeddings=4096)
GEMMA2_2B = dict(hidden_size=2304, num_hidden_layers=26, intermediate_size=9216, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=256, vocab_size=256000, final_logit_softcapping=30.0,
                 attn_logit_softcapping=50.0, max_position_embeddings=8192)
PHI3_MINI = dict(hidden_size=3072, num_hidden_layers=32, intermediate_size=8192, num_attention_heads=32,
                 num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096)
OLMO2_7B = dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=11008, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=100352, max_position_embeddings=4096)
MISTRAL_7B = dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=32000, max_position_embeddings=8192, sliding_window=None)
OPT350 = dict(hidden_size=1024, num_hidden_layers=24, ffn_dim=4096, num_attention_heads=16, vocab_size=50272,
              word_embed_proj_dim=512, max_position_embeddings=2048)
GPT2_1B = dict(n_embd=1600, n_layer=24, n_head=25, vocab_size=50257, n_positions=2048)
QWEN2MOE_1B = dict(hidden_size=1024, num_hidden_layers=12, intermediate_size=2816, moe_intermediate_size=512,
                   shared_expert_intermediate_size=2048, num_experts=16, num_experts_per_tok=4,
                   num_attention_heads=16, num_key_value_heads=16, vocab_size=32000, max_position_embeddings=4096)
STABLELM_3B = dict(hidden_size=2560, num_hidden_layers=32, intermediate_size=6912, num_attention_heads=32,
                   num_key_value_heads=32, vocab_size=50304, max_position_embeddings=4096)
T5_V11_BASE = dict(d_model=768, d_ff=2048, num_layers=12, num_decoder_layers=12, num_heads=12, d_kv=64,
                   vocab_size=32128, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
BART_LARGE = dict(d_model=1024, encoder_layers=12, decoder_layers=12, encoder_attention_heads=16,
                  decoder_attention_heads=16, encoder_ffn_dim=4096, decoder_ffn_dim=4096, vocab_size=50265,
                  max_position_embeddings=1024)
ROBERTA_LARGE = dict(hidden_size=1024, num_hidden_layers=24, intermediate_size=4096, num_attention_heads=16,
                     vocab_size=50265, max_position_embeddings=514)
DEBERTA_BASE = dict(hidden_size=768, num_hidden_layers=12, intermediate_size=3072, num_attention_heads=12,
                    vocab_size=128100, max_position_embeddings=512, relative_attention=True,
                    position_biased_input=False, pos_att_type=["p2c", "c2p"], num_labels=3)
ELECTRA_LARGE = dict(hidden_size=1024, num_hidden_layers=24, intermediate_size=4096, num_attention_heads=16,
                     vocab_size=30522, embedding_size=1024, num_labels=9)
VIT_HUGE_ISH = dict(hidden_size=1280, num_hidden_layers=24, intermediate_size=5120, num_attention_heads=16,
                    image_size=224, patch_size=14, num_labels=1000)
CONVNEXT_BASE = dict(hidden_sizes=[128, 256, 512, 1024], depths=[3, 3, 27, 3], num_labels=1000)
SWIN_BASE = dict(embed_dim=128, depths=[2, 2, 18, 2], num_heads=[4, 8, 16, 32], image_size=224, num_labels=1000)

ROWS: list[ZooRow] = [
    _llm("mistral7b-2x4096-100GB", "mistral", MISTRAL_7B, 2, 4096, "100GB"),
    _llm("tinyllama1.1b-16x2048-24GiB", "llama", TINYLLAMA, 16, 2048, "24GiB"),
    _llm("tinyllama1.1b-16x2048-24GiB-8bit", "llama", TINYLLAMA, 16, 2048, "24GiB", fidelity="8bit"),
    _llm("tinyllama1.1b-4x4096-16GB", "llama", TINYLLAMA, 4, 4096, "16GB"),
    _llm("pythia410m-16x2048-16GiB", "gpt_neox", PYTHIA410, 16, 2048, "16GiB"),
    _llm("pythia410m-32x1024-10GB", "gpt_neox", PYTHIA410, 32, 1024, "10GB"),
    _llm("gemma2-2b-8x2048-24GiB", "gemma2", GEMMA2_2B, 8, 2048, "24GiB"),
    _llm("gemma2-2b-8x2048-40GB", "gemma2", GEMMA2_2B, 8, 2048, "40GB"),
    _llm("phi3mini3.8b-8x2048-60GB", "phi3", PHI3_MINI, 8, 2048, "60GB"),
    _llm("phi3mini3.8b-4x2048-40GiB-8bit", "phi3", PHI3_MINI, 4, 2048, "40GiB", fidelity="8bit"),
    _llm("olmo2-7b-4x2048-80GB", "olmo2", OLMO2_7B, 4, 2048, "80GB"),
    _llm("opt350m-16x2048-12GiB", "opt", OPT350, 16, 2048, "12GiB"),
    _llm("gpt2-1.1b-8x1024-16GiB", "gpt2", GPT2_1B, 8, 1024, "16GiB"),
    _llm("gpt2-1.1b-16x2048-32GB", "gpt2", GPT2_1B, 16, 2048, "32GB"),
    _llm("qwen2moe1b-8x2048-24GiB", "qwen2_moe", QWEN2MOE_1B, 8, 2048, "24GiB"),
    _llm("qwen2moe1b-16x1024-12GiB", "qwen2_moe", QWEN2MOE_1B, 16, 1024, "12GiB"),
    _llm("stablelm3b-8x2048-32GiB", "stablelm", STABLELM_3B, 8, 2048, "32GiB"),
    ZooRow("t5v11base-16x512-12GiB", "seq2seq", "t5", T5_V11_BASE, 16, 512, budget="12GiB"),
    ZooRow("t5v11base-32x1024-24GiB", "seq2seq", "t5", T5_V11_BASE, 32, 1024, budget="24GiB"),
    ZooRow("bartlarge-16x1024-16GiB", "seq2seq", "bart", BART_LARGE, 16, 1024, budget="16GiB"),
    ZooRow("robertalarge-mlm-32x512-12GiB", "masked", "roberta", ROBERTA_LARGE, 32, 512, budget="12GiB"),
    ZooRow("debertav2base-cls-32x512-10GB", "seqcls", "deberta-v2", DEBERTA_BASE, 32, 512, budget="10GB"),
    ZooRow("electralarge-tok-32x512-12GiB", "tokcls", "electra", ELECTRA_LARGE, 32, 512, budget="12GiB"),
    ZooRow("vit632m-64x224-24GiB", "image", "vit", VIT_HUGE_ISH, 64, image_size=224, budget="24GiB"),
    ZooRow("vit632m-128x224-40GB", "image", "vit", VIT_HUGE_ISH, 128, image_size=224, budget="40GB"),
    ZooRow("convnextbase-64x224-12GiB", "image", "convnext", CONVNEXT_BASE, 64, image_size=224, budget="12GiB"),
    ZooRow("swinbase-64x224-16GiB", "image", "swin", SWIN_BASE, 64, image_size=224, budget="16GiB"),
    ZooRow("wideresnet101-128x224-20GB", "torchvision", "wide_resnet101_2", {}, 128, image_size=224,
           budget="20GB"),
    ZooRow("tied-resmlp-16blk-4x2048-12GiB", "custom", "tied_resmlp", dict(vocab=32000, width=2048, blocks=16),
           4, 2048, budget="12GiB"),
    ZooRow("gru-lm-32x512-8GiB", "custom", "gru_lm", dict(vocab=32000, width=1536, layers=3), 32, 512,
           budget="8GiB"),
    ZooRow("mha-encoder-32x1024-12GiB", "custom", "mha_encoder", dict(vocab=32000, width=1024, layers=12), 32,
           1024, budget="12GiB"),
    # the same kinds of model fed as a plain loop feeds them: (inputs, targets) tuples and a loss of the user's
    ZooRow("tuple-resnet152-96x224-12GiB", "torchvision", "resnet152", {}, 96, image_size=224, budget="12GiB",
           extra={"tuple": True}),
    ZooRow("tuple-gru-lm-16x1024-6GiB", "custom", "gru_lm", dict(vocab=16000, width=2048, layers=2), 16, 1024,
           budget="6GiB", extra={"tuple": True}),
    ZooRow("step-mha-encoder-16x2048-10GB", "custom", "mha_encoder", dict(vocab=32000, width=1536, layers=16), 16,
           2048, budget="10GB", extra={"training_step": True}),
    # loops as their users write them: nanoGPT's (its optimizer and schedule built first), a loss summed over tokens
    ZooRow("nanogpt350m-16x1024-12GiB", "custom", "nanogpt", dict(vocab=50304, width=1024, layers=24, heads=16,
                                                                   seq=1024), 16, 1024, budget="12GiB",
           extra={"nanogpt_loop": True}),
    ZooRow("summed-gru-lm-16x1024-6GiB", "custom", "gru_lm", dict(vocab=16000, width=2048, layers=2), 16, 1024,
           budget="6GiB", extra={"tuple": True, "loss_reduction": "sum"}),
    # budgets that split the batch, so the loss's reduction is measured: in the plan's step (micro-batches of 4) and
    # in the one-GPU offload engine's (micro-batches of 1, the check's forward at 2 samples)
    ZooRow("summed-gru-lm-16x1024-4GiB", "custom", "gru_lm", dict(vocab=16000, width=2048, layers=2), 16, 1024,
           budget="4GiB", extra={"tuple": True, "loss_reduction": "sum"}),
    ZooRow("summed-gru-lm-16x1024-2.5GiB", "custom", "gru_lm", dict(vocab=16000, width=2048, layers=2), 16, 1024,
           budget="2.5GiB", extra={"tuple": True, "loss_reduction": "sum"}),
]

# families and plain-PyTorch shapes that no earlier row ran on the GPU: q/k norms, tied big vocabularies, logit
# scaling heads, parallel attention, ALiBi, MoE routing of another family, unpadding encoders, stochastic depth,
# depthwise convolutions, dense concatenation, torchvision's own attention
QWEN3_06B = dict(hidden_size=1024, num_hidden_layers=28, intermediate_size=3072, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                 max_position_embeddings=8192)
QWEN3_17B = dict(hidden_size=2048, num_hidden_layers=28, intermediate_size=6144, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                 max_position_embeddings=8192)
GRANITE_1B = dict(hidden_size=2048, num_hidden_layers=24, intermediate_size=8192, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=49152, logits_scaling=8.0, embedding_multiplier=12.0,
                  residual_multiplier=0.22, attention_multiplier=0.015625, max_position_embeddings=4096,
                  tie_word_embeddings=True)
COHERE_2B = dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=5632, num_attention_heads=16,
                 num_key_value_heads=16, vocab_size=256000, logit_scale=0.0625, max_position_embeddings=4096)
MIXTRAL_SMALL = dict(hidden_size=1024, num_hidden_layers=16, intermediate_size=3584, num_local_experts=8,
                     num_experts_per_tok=2, num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
                     max_position_embeddings=4096, sliding_window=None)
FALCON_1B = dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, new_decoder_architecture=False,
                 parallel_attn=True, multi_query=True, alibi=False, bias=False, vocab_size=65024)
BLOOM_560M = dict(hidden_size=1024, n_layer=24, n_head=16, vocab_size=250880)
GPTJ_1B = dict(n_embd=2048, n_layer=16, n_head=16, rotary_dim=64, vocab_size=50400, n_positions=2048)
STARCODER2_3B = dict(hidden_size=3072, num_hidden_layers=30, intermediate_size=12288, num_attention_heads=24,
                     num_key_value_heads=2, vocab_size=49152, max_position_embeddings=8192, sliding_window=None)
PHI2_LIKE = dict(hidden_size=2048, num_hidden_layers=24, intermediate_size=8192, num_attention_heads=32,
                 vocab_size=51200, partial_rotary_factor=0.5, max_position_embeddings=2048)
GEMMA1_2B = dict(hidden_size=2048, num_hidden_layers=18, intermediate_size=16384, num_attention_heads=8,
                 num_key_value_heads=1, head_dim=256, vocab_size=256000, max_position_embeddings=8192)
MT5_SMALL = dict(d_model=512, d_ff=1024, num_layers=8, num_decoder_layers=8, num_heads=6, d_kv=64,
                 vocab_size=250112, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                 decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
PEGASUS_LARGE = dict(d_model=1024, encoder_layers=16, decoder_layers=16, encoder_attention_heads=16,
                     decoder_attention_heads=16, encoder_ffn_dim=4096, decoder_ffn_dim=4096, vocab_size=96103,
                     max_position_embeddings=1024, pad_token_id=0, decoder_start_token_id=0)
BERT_LARGE_CLS = dict(hidden_size=1024, num_hidden_layers=24, intermediate_size=4096, num_attention_heads=16,
                      vocab_size=28996, max_position_embeddings=512, num_labels=5)
MODERNBERT_BASE = dict(hidden_size=768, num_hidden_layers=22, intermediate_size=1152, num_attention_heads=12,
                       vocab_size=50368, max_position_embeddings=8192)
DINOV2_LARGE = dict(hidden_size=1024, num_hidden_layers=24, intermediate_size=4096, num_attention_heads=16,
                    image_size=224, patch_size=14, num_labels=1000)
BEIT_BASE = dict(hidden_size=768, num_hidden_layers=12, intermediate_size=3072, num_attention_heads=12,
                 image_size=224, patch_size=16, use_relative_position_bias=True, num_labels=1000)

ROWS += [
    _llm("qwen3like0.6b-16x2048-16GiB", "qwen3", QWEN3_06B, 16, 2048, "16GiB"),
    _llm("qwen3like1.7b-16x1024-12GiB-8bit", "qwen3", QWEN3_17B, 16, 1024, "12GiB", fidelity="8bit"),
    _llm("granitelike1b-8x2048-20GiB", "granite", GRANITE_1B, 8, 2048, "20GiB"),
    _llm("coherelike2b-8x2048-32GB", "cohere", COHERE_2B, 8, 2048, "32GB"),
    _llm("mixtrallike-8x2048-24GiB", "mixtral", MIXTRAL_SMALL, 8, 2048, "24GiB"),
    _llm("falconlike1b-16x2048-24GiB", "falcon", FALCON_1B, 16, 2048, "24GiB"),
    _llm("bloomlike560m-16x1024-16GiB", "bloom", BLOOM_560M, 16, 1024, "16GiB"),
    _llm("gptjlike1b-8x2048-16GB", "gptj", GPTJ_1B, 8, 2048, "16GB"),
    _llm("starcoder2like3b-4x4096-48GiB", "starcoder2", STARCODER2_3B, 4, 4096, "48GiB"),
    _llm("phi2like-8x2048-24GiB", "phi", PHI2_LIKE, 8, 2048, "24GiB"),
    _llm("gemma1like2b-8x2048-40GB", "gemma", GEMMA1_2B, 8, 2048, "40GB"),
    ZooRow("mt5small-32x512-12GiB", "seq2seq", "mt5", MT5_SMALL, 32, 512, budget="12GiB"),
    ZooRow("pegasuslarge-16x512-16GiB", "seq2seq", "pegasus", PEGASUS_LARGE, 16, 512, budget="16GiB"),
    ZooRow("bertlarge-cls-64x512-12GiB", "seqcls", "bert", BERT_LARGE_CLS, 64, 512, budget="12GiB"),
    ZooRow("modernbertbase-mlm-32x1024-10GiB", "masked", "modernbert", MODERNBERT_BASE, 32, 1024, budget="10GiB"),
    ZooRow("dinov2large-64x224-16GiB", "image", "dinov2", DINOV2_LARGE, 64, image_size=224, budget="16GiB"),
    ZooRow("beitbase-128x224-12GiB", "image", "beit", BEIT_BASE, 128, image_size=224, budget="12GiB"),
    ZooRow("efficientnetb4-64x380-16GiB", "torchvision", "efficientnet_b4", {}, 64, image_size=380, budget="16GiB"),
    ZooRow("tuple-densenet201-64x224-10GiB", "torchvision", "densenet201", {}, 64, image_size=224, budget="10GiB",
           extra={"tuple": True}),
    ZooRow("tvvitb16-128x224-16GiB", "torchvision", "vit_b_16", {}, 128, image_size=224, budget="16GiB"),
    ZooRow("mobilenetv3l-256x224-6GiB", "torchvision", "mobilenet_v3_large", {}, 256, image_size=224,
           budget="6GiB"),
    ZooRow("step-tied-resmlp-24blk-8x1024-10GB", "custom", "tied_resmlp", dict(vocab=50000, width=1536, blocks=24),
           8, 1024, budget="10GB", extra={"training_step": True}),
    ZooRow("lstm-tagger-64x256-6GiB", "custom", "lstm_tagger", dict(vocab=24000, width=1024, layers=3), 64, 256,
           budget="6GiB"),
    # models kept in their own dtypes (memopt casts weights only under bf16_pure/bf16_master): loaded in bf16, fp64
    _llm("qwen3like0.6b-bf16weights-16x2048-12GiB", "qwen3", QWEN3_06B, 16, 2048, "12GiB",
         extra={"dtype": "bfloat16"}),
    ZooRow("fp64-resmlp-12blk-8x512-10GB", "custom", "tied_resmlp", dict(vocab=16000, width=1024, blocks=12), 8, 512,
           budget="10GB", extra={"dtype": "float64"}),
]

# families and shapes no earlier row ran: one layer shared by every depth (ALBERT, a looped encoder), multi-query
# attention, routed experts of two more families (OLMoE; DeepSeek-V3's latent attention with a dense first block),
# short convolutions beside attention (LFM2), a 250k-token encoder, torchvision's RegNet, complex spectral weights
ALBERT_LARGE = dict(hidden_size=1024, num_hidden_layers=24, intermediate_size=4096, num_attention_heads=16,
                    embedding_size=128, vocab_size=30000, max_position_embeddings=512)
GPT_BIGCODE_1B = dict(n_embd=2048, n_layer=24, n_head=16, n_inner=8192, multi_query=True, vocab_size=49152,
                      n_positions=4096)
OLMOE_SMALL = dict(hidden_size=1024, num_hidden_layers=12, intermediate_size=1024, num_experts=16,
                   num_experts_per_tok=4, num_attention_heads=16, num_key_value_heads=16, vocab_size=50304,
                   max_position_embeddings=4096)
DEEPSEEK_V3_SMALL = dict(hidden_size=1024, num_hidden_layers=12, intermediate_size=2816, moe_intermediate_size=512,
                         n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1,
                         n_group=1, topk_group=1, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=384,
                         kv_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
                         vocab_size=32000, max_position_embeddings=4096, rope_scaling=None)
LFM2_1B = dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=65536, max_position_embeddings=4096,
               layer_types=["conv", "conv", "full_attention"] * 5 + ["conv"])
MBART_LARGE = dict(d_model=1024, encoder_layers=12, decoder_layers=12, encoder_attention_heads=16,
                   decoder_attention_heads=16, encoder_ffn_dim=4096, decoder_ffn_dim=4096, vocab_size=50265,
                   max_position_embeddings=1024, pad_token_id=1, decoder_start_token_id=2)
XLMR_BASE = dict(hidden_size=768, num_hidden_layers=12, intermediate_size=3072, num_attention_heads=12,
                 vocab_size=250002, max_position_embeddings=514, num_labels=3)

ROWS += [
    ZooRow("albertlarge-mlm-32x512-8GiB", "masked", "albert", ALBERT_LARGE, 32, 512, budget="8GiB"),
    _llm("gptbigcode1b-8x2048-20GiB", "gpt_bigcode", GPT_BIGCODE_1B, 8, 2048, "20GiB"),
    _llm("olmoelike-8x2048-16GiB", "olmoe", OLMOE_SMALL, 8, 2048, "16GiB"),
    _llm("deepseekv3like-8x2048-16GiB", "deepseek_v3", DEEPSEEK_V3_SMALL, 8, 2048, "16GiB"),
    _llm("lfm2like1b-8x2048-20GiB", "lfm2", LFM2_1B, 8, 2048, "20GiB"),
    ZooRow("mbartlarge-16x512-12GiB", "seq2seq", "mbart", MBART_LARGE, 16, 512, budget="12GiB"),
    ZooRow("xlmrbase-cls-32x512-8GiB", "seqcls", "xlm-roberta", XLMR_BASE, 32, 512, budget="8GiB"),
    ZooRow("regnety16gf-64x224-12GiB", "torchvision", "regnet_y_16gf", {}, 64, image_size=224, budget="12GiB"),
    ZooRow("fno2d-32x256-8GiB", "custom", "fno2d", dict(width=64, modes=32, layers=4), 32, image_size=256,
           budget="8GiB"),
    ZooRow("looped-encoder-16x1024-8GiB", "custom", "looped_encoder", dict(vocab=32000, width=1024, loops=12), 16,
           1024, budget="8GiB"),
]


# session 31: what a user's script does to the model before wrap, and blocks of unusual form
ROWS += [
    _llm("tinyllama-owngc-8x2048-16GiB", "llama", TINYLLAMA, 8, 2048, "16GiB", extra={"own_checkpointing": True}),
    _llm("qwen3like0.6b-owngc-16x2048-16GiB", "qwen3", QWEN3_06B, 16, 2048, "16GiB",
         extra={"own_checkpointing": True}),
    _llm("tinyllama-peftlora-8x2048-12GiB", "llama", TINYLLAMA, 8, 2048, "12GiB", extra={"peft_lora": True}),
    ZooRow("ema-resmlp-16blk-8x1024-10GiB", "custom", "ema_resmlp", dict(vocab=32000, width=1536, blocks=16), 8,
           1024, budget="10GiB"),
    ZooRow("inplace-resmlp-16blk-8x1024-10GiB", "custom", "inplace_resmlp", dict(vocab=32000, width=1536, blocks=16),
           8, 1024, budget="10GiB"),
    ZooRow("weightnorm-resmlp-16blk-8x4096-5GiB", "custom", "weightnorm_resmlp",
           dict(vocab=32000, width=1536, blocks=16), 8, 4096, budget="5GiB"),
    # batches as tokenizers, collators and typed loops hold them: a BatchEncoding, a dataclass
    _llm("qwen3like0.6b-batchenc-16x2048-16GiB", "qwen3", QWEN3_06B, 16, 2048, "16GiB",
         extra={"batch_encoding": True}),
    _llm("tinyllama-dataclass-8x2048-12GiB", "llama", TINYLLAMA, 8, 2048, "12GiB", extra={"dataclass": True}),
]


# session 35: a run of blocks among other layers (torchvision's MobileNetV2 features, a Sequential language model),
# one whole graph as the batch (its tensors disagree on dim 0), scripted blocks
ROWS += [
    ZooRow("mobilenetv2-256x224-6GiB", "torchvision", "mobilenet_v2", {}, 256, image_size=224, budget="6GiB"),
    ZooRow("seq-resmlp-24blk-8x2048-12GiB", "custom", "sequential_resmlp", dict(vocab=32000, width=1536, blocks=24),
           8, 2048, budget="12GiB"),
    ZooRow("graphnet-200knodes-6GiB", "custom", "graph_net",
           dict(features=128, width=512, layers=6, classes=40, edges=2_000_000), 200_000, budget="6GiB"),
    ZooRow("scripted-resmlp-12blk-8x1024-10GiB", "custom", "scripted_resmlp", dict(vocab=32000, width=1536, blocks=12),
           8, 1024, budget="10GiB"),
]


@dataclass
class LoopBatch:
    """A typed loop's batch: the model's inputs and its labels in the fields of a dataclass."""
    input_ids: Any
    labels: Any


# ---------------------------------------------------------------------------------------------------------------
# models and batches
# ---------------------------------------------------------------------------------------------------------------

def _residual_and_graph_layers() -> tuple[Any, Any]:
    import torch
    from torch import nn

    class Residual(nn.Module):
        def __init__(self, w: int) -> None:
            super().__init__()
            self.norm, self.up, self.down = nn.LayerNorm(w), nn.Linear(w, 4 * w), nn.Linear(4 * w, w)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h + self.down(nn.functional.gelu(self.up(self.norm(h))))

    class GraphLayer(nn.Module):
        def __init__(self, w: int) -> None:
            super().__init__()
            self.norm, self.msg, self.upd = nn.LayerNorm(w), nn.Linear(w, w), nn.Linear(2 * w, w)

        def forward(self, h: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
            m = nn.functional.gelu(self.msg(self.norm(h)))
            agg = torch.zeros_like(m).index_add_(0, edge_index[1], m[edge_index[0]])
            return h + self.upd(torch.cat([h, agg], dim=-1))

    return Residual, GraphLayer


def _custom_model(name: str, c: dict[str, Any]) -> Any:
    import torch
    from torch import nn

    _Residual, _GraphLayer = _residual_and_graph_layers()

    class TiedResMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(c["vocab"], c["width"])
            self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(c["width"]), nn.Linear(c["width"], 4 * c["width"]),
                                                      nn.GELU(), nn.Linear(4 * c["width"], c["width"]))
                                        for _ in range(c["blocks"]))
            self.norm = nn.LayerNorm(c["width"])

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            h = self.embed(input_ids)
            for block in self.blocks:
                h = h + block(h)
            logits = self.norm(h) @ self.embed.weight.t()
            return {"loss": nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())}

    class EMAResMLP(TiedResMLP):  # a moving average of the embeddings kept as state: micro-batches may not split
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("embed_mean", torch.zeros(c["width"]))

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            with torch.no_grad():
                self.embed_mean.mul_(0.99).add_(0.01 * self.embed(input_ids).float().mean((0, 1)))
            return super().forward(input_ids, labels)

    class _InplaceBlock(nn.Module):  # nn.ReLU(inplace=True) and `out += x` on Linear outputs: selective refused
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.up = nn.LayerNorm(c["width"]), nn.Linear(c["width"], 4 * c["width"])
            self.act, self.down = nn.ReLU(inplace=True), nn.Linear(4 * c["width"], c["width"])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.down(self.act(self.up(self.norm(x))))
            out += x
            return out

    class InplaceResMLP(TiedResMLP):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(_InplaceBlock() for _ in range(c["blocks"]))

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            h = self.embed(input_ids)
            for block in self.blocks:
                h = block(h)
            logits = self.norm(h) @ self.embed.weight.t()
            return {"loss": nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())}

    class WeightNormResMLP(TiedResMLP):  # every block a weight-normed layer: parametrize gives each its own class
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.utils.parametrizations.weight_norm(nn.Linear(c["width"], c["width"]))
                                        for _ in range(c["blocks"]))

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            h = self.embed(input_ids)
            for block in self.blocks:
                h = h + nn.functional.gelu(block(h))
            logits = self.norm(h) @ self.embed.weight.t()
            return {"loss": nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())}

    class SequentialResMLP(nn.Module):  # nn.Sequential(embedding, *blocks, norm): a run of blocks among other layers
        def __init__(self) -> None:
            super().__init__()
            w = c["width"]
            self.net = nn.Sequential(nn.Embedding(c["vocab"], w), *[_Residual(w) for _ in range(c["blocks"])],
                                     nn.LayerNorm(w))
            self.head = nn.Linear(w, c["vocab"], bias=False)

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            logits = self.head(self.net(input_ids))
            return {"loss": nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())}

    class ScriptedResMLP(TiedResMLP):  # blocks compiled with torch.jit.script (no hooks: no checkpointing)
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(torch.jit.script(block) for block in self.blocks)

    class GraphNet(nn.Module):  # message passing over one whole graph: node features and a (2, edges) edge index
        def __init__(self) -> None:
            super().__init__()
            w = c["width"]
            self.inp = nn.Linear(c["features"], w)
            self.layers = nn.ModuleList(_GraphLayer(w) for _ in range(c["layers"]))
            self.head = nn.Linear(w, c["classes"])

        def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)
            for layer in self.layers:
                h = layer(h, edge_index)
            return self.head(h)

    class GRULM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(c["vocab"], c["width"])
            self.rnn = nn.GRU(c["width"], c["width"], num_layers=c["layers"], batch_first=True)
            self.head = nn.Linear(c["width"], c["vocab"])

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            h, _ = self.rnn(self.embed(input_ids))
            return {"loss": nn.functional.cross_entropy(self.head(h).flatten(0, 1).float(), labels.flatten())}

    class LSTMTagger(nn.Module):  # bidirectional, a projection, a dropout between layers: cuDNN's other paths
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(c["vocab"], c["width"])
            self.rnn = nn.LSTM(c["width"], c["width"], num_layers=c["layers"], batch_first=True, bidirectional=True,
                               proj_size=c["width"] // 2, dropout=0.1)
            self.head = nn.Linear(c["width"], c["vocab"])

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            h, _ = self.rnn(self.embed(input_ids))
            return {"loss": nn.functional.cross_entropy(self.head(h).flatten(0, 1).float(), labels.flatten())}

    class MHAEncoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(c["vocab"], c["width"])
            layer = nn.TransformerEncoderLayer(c["width"], c["width"] // 64, 4 * c["width"], batch_first=True,
                                               norm_first=True, dropout=0.0)
            self.encoder = nn.TransformerEncoder(layer, c["layers"], enable_nested_tensor=False)
            self.head = nn.Linear(c["width"], c["vocab"])

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            h = self.encoder(self.embed(input_ids))
            return {"loss": nn.functional.cross_entropy(self.head(h).flatten(0, 1).float(), labels.flatten())}

    class SpectralConv(nn.Module):  # a Fourier layer: complex weights on the lowest modes of a real 2-D FFT
        def __init__(self) -> None:
            super().__init__()
            w, m = c["width"], c["modes"]
            self.low = nn.Parameter(torch.randn(w, w, m, m, dtype=torch.cfloat) / (w * w))
            self.high = nn.Parameter(torch.randn(w, w, m, m, dtype=torch.cfloat) / (w * w))
            self.mix = nn.Conv2d(w, w, 1)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            m = c["modes"]
            f = torch.fft.rfft2(h.float())  # cuFFT has no bf16: the user's own cast, as under AMP
            out = torch.zeros_like(f)
            out[:, :, :m, :m] = torch.einsum("bixy,ioxy->boxy", f[:, :, :m, :m], self.low)
            out[:, :, -m:, :m] = torch.einsum("bixy,ioxy->boxy", f[:, :, -m:, :m], self.high)
            return nn.functional.gelu(torch.fft.irfft2(out, s=h.shape[-2:]) + self.mix(h))

    class FNO2d(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lift = nn.Conv2d(3, c["width"], 1)
            self.layers = nn.ModuleList(SpectralConv() for _ in range(c["layers"]))
            self.project = nn.Sequential(nn.Conv2d(c["width"], 128, 1), nn.GELU(), nn.Conv2d(128, 1, 1))

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
            h = self.lift(x)
            for layer in self.layers:
                h = layer(h)
            return {"loss": nn.functional.mse_loss(self.project(h).float(), y)}

    class LoopedEncoder(nn.Module):  # one layer applied at every depth, listed once per application
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(c["vocab"], c["width"])
            layer = nn.TransformerEncoderLayer(c["width"], c["width"] // 64, 4 * c["width"], batch_first=True,
                                               norm_first=True, dropout=0.0)
            self.layers = nn.ModuleList([layer] * c["loops"])
            self.head = nn.Linear(c["width"], c["vocab"])

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            h = self.embed(input_ids)
            for layer in self.layers:
                h = layer(h)
            return {"loss": nn.functional.cross_entropy(self.head(h).flatten(0, 1).float(), labels.flatten())}

    class NanoGPT(nn.Module):  # nanoGPT's shape: tied head, fused QKV, SDPA, forward(idx, targets) -> (logits, loss)
        def __init__(self) -> None:
            super().__init__()
            w = c["width"]
            self.wte = nn.Embedding(c["vocab"], w)
            self.wpe = nn.Embedding(c["seq"], w)
            self.blocks = nn.ModuleList(_GPTBlock(w, c["heads"]) for _ in range(c["layers"]))
            self.ln_f = nn.LayerNorm(w)
            self.lm_head = nn.Linear(w, c["vocab"], bias=False)
            self.wte.weight = self.lm_head.weight

        def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            logits = self.lm_head(self.ln_f(x))
            return logits, nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                                                       ignore_index=-1)

    class _GPTBlock(nn.Module):
        def __init__(self, w: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.ln_1, self.ln_2 = nn.LayerNorm(w), nn.LayerNorm(w)
            self.qkv, self.proj = nn.Linear(w, 3 * w), nn.Linear(w, w)
            self.mlp = nn.Sequential(nn.Linear(w, 4 * w), nn.GELU(), nn.Linear(4 * w, w))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, w = x.shape
            q, k, v = (z.view(b, t, self.heads, w // self.heads).transpose(1, 2)
                       for z in self.qkv(self.ln_1(x)).split(w, dim=2))
            y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, w))
            return x + self.mlp(self.ln_2(x))

    return {"tied_resmlp": TiedResMLP, "gru_lm": GRULM, "lstm_tagger": LSTMTagger, "mha_encoder": MHAEncoder,
            "fno2d": FNO2d, "looped_encoder": LoopedEncoder, "nanogpt": NanoGPT, "ema_resmlp": EMAResMLP,
            "sequential_resmlp": SequentialResMLP, "scripted_resmlp": ScriptedResMLP, "graph_net": GraphNet,
            "inplace_resmlp": InplaceResMLP, "weightnorm_resmlp": WeightNormResMLP}[name]()


def build(row: ZooRow) -> Any:
    import torch

    torch.manual_seed(0)
    if "dtype" in row.extra:  # the user's model in its own dtype
        return build(dataclasses.replace(row, extra={k: v for k, v in row.extra.items() if k != "dtype"})).to(
            getattr(torch, row.extra["dtype"]))
    if row.kind == "custom":
        return _custom_model(row.model_type, row.config)
    if row.kind == "torchvision":
        import torchvision

        return getattr(torchvision.models, row.model_type)(weights=None)
    import transformers as tf

    config = tf.AutoConfig.for_model(row.model_type, **row.config)
    auto = {"causal": tf.AutoModelForCausalLM, "seq2seq": tf.AutoModelForSeq2SeqLM, "masked": tf.AutoModelForMaskedLM,
            "seqcls": tf.AutoModelForSequenceClassification, "tokcls": tf.AutoModelForTokenClassification,
            "image": tf.AutoModelForImageClassification}[row.kind]
    return auto.from_config(config)  # the default attention: SDPA where the family supports it


def batch_for(row: ZooRow, model: Any) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(1)
    b, s = row.batch_size, row.seq_len
    if row.kind in ("image", "torchvision"):
        x = torch.randn(b, 3, row.image_size, row.image_size, generator=g)
        labels = torch.randint(0, 1000, (b,), generator=g)
        return {"pixel_values": x, "labels": labels} if row.kind == "image" else {"x": x, "labels": labels}
    if row.model_type == "graph_net":  # one whole graph: n nodes, their features and a (2, edges) edge index
        n, c = row.batch_size, row.config
        return {"x": torch.randn(n, c["features"], generator=g),
                "edge_index": torch.randint(0, n, (2, c["edges"]), generator=g),
                "y": torch.randint(0, c["classes"], (n,), generator=g)}
    if row.model_type == "fno2d":  # a field in, a field out
        n = row.image_size
        return {"x": torch.randn(b, 3, n, n, generator=g), "y": torch.randn(b, 1, n, n, generator=g)}
    vocab = row.config.get("vocab_size", row.config.get("vocab", 32000))
    ids = torch.randint(0, vocab, (b, s), generator=g)
    if row.kind == "seq2seq":
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "labels": torch.randint(0, vocab, (b, max(16, s // 4)), generator=g)}
    if row.kind == "seqcls":
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "labels": torch.randint(0, row.config.get("num_labels", 2), (b,), generator=g)}
    if row.kind == "tokcls":
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "labels": torch.randint(0, row.config.get("num_labels", 2), (b, s), generator=g)}
    if row.kind == "masked":
        labels = torch.where(torch.rand(b, s, generator=g) < 0.15, ids, torch.full_like(ids, -100))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    if row.kind == "custom":  # these models do not shift their labels: the next token, not the same one (whose
        # tied-embedding logit wins by the embedding's squared norm, so the loss was 0.0 from the first step)
        return {"input_ids": ids, "labels": torch.roll(ids, -1, dims=1)}
    return {"input_ids": ids, "labels": ids.clone()}  # transformers' causal heads shift the labels themselves


def _torchvision_loss(output: Any, batch: dict[str, Any]) -> Any:
    import torch

    return torch.nn.functional.cross_entropy(output.float(), batch["labels"])


class _TorchvisionAdapter:
    """torchvision classifiers take one positional tensor: the batch's ``x``."""

    @staticmethod
    def wrap(model: Any) -> Any:
        import torch

        class Adapter(torch.nn.Module):
            def __init__(self, inner: Any) -> None:
                super().__init__()
                self.inner = inner

            def forward(self, x: Any, labels: Any = None) -> Any:
                return self.inner(x)

        return Adapter(model)


def _as_tuple_loop(row: ZooRow, model: Any, batch: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """The model as a plain loop holds it: called on the inputs alone, the loss made from (output, (x, y))."""
    import torch

    if row.kind == "torchvision":
        inner = model.inner  # the adapter's torchvision module takes the image tensor positionally
        return inner, (batch["x"], batch["labels"]), {
            "loss_fn": lambda out, b: torch.nn.functional.cross_entropy(out.float(), b[1])}

    class Logits(torch.nn.Module):
        def __init__(self, lm: Any) -> None:
            super().__init__()
            self.lm = lm

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h, _ = self.lm.rnn(self.lm.embed(ids))
            return self.lm.head(h)

    reduction = row.extra.get("loss_reduction", "mean")  # "sum": a loss summed over the tokens, not averaged
    return Logits(model), (batch["input_ids"], batch["labels"]), {
        "loss_fn": lambda out, b: torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), b[1].flatten(),
                                                                    reduction=reduction)}


def _nanogpt_loop(model: Any, batch: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """nanoGPT's train.py as a user brings it: an (X, Y) tuple, the model returning (logits, loss), and the AdamW it
    builds itself (decay on the matrices only, fused) with a warm-up schedule on it."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 100))
    return model, (batch["input_ids"], batch["labels"]), {"optimizer": opt, "lr_scheduler": sched}


def user_loop(row: ZooRow) -> tuple[Any, Any, dict[str, Any]]:
    """The row's model, batch and the ``memopt.wrap`` arguments saying how its loss is made, as its user holds them."""
    model = build(row)
    if row.kind == "torchvision":
        model = _TorchvisionAdapter.wrap(model)
    if row.extra.get("own_checkpointing"):  # a fine-tuning script's usual line before wrap
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if row.extra.get("peft_lora"):  # adapters the user added with peft, without a task type
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=16, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                  "o_proj"]))
    batch = batch_for(row, model)
    if row.extra.get("nanogpt_loop"):
        return _nanogpt_loop(model, batch)
    if row.extra.get("tuple"):  # a plain loop's (inputs, targets): the model called on the inputs
        return _as_tuple_loop(row, model, batch)
    if row.model_type == "graph_net":  # node classification: the loss made from the model's output
        import torch

        return model, batch, {"training_step": lambda m, b: torch.nn.functional.cross_entropy(
            m(b["x"], b["edge_index"]).float(), b["y"])}
    if row.extra.get("training_step"):  # a Lightning-style step: the user calls the model
        return model, batch, {"training_step": lambda m, b: m(**b)["loss"]}
    if row.extra.get("batch_encoding"):  # what a tokenizer or a collator returns: a UserDict
        import transformers

        return model, transformers.BatchEncoding(batch), {"loss_fn": None}
    if row.extra.get("dataclass"):
        return model, LoopBatch(batch["input_ids"], batch["labels"]), {
            "training_step": lambda m, b: m(input_ids=b.input_ids, labels=b.labels).loss}
    return model, batch, {"loss_fn": _torchvision_loss if row.kind == "torchvision" else None}


# ---------------------------------------------------------------------------------------------------------------
# one row
# ---------------------------------------------------------------------------------------------------------------

def _process_gpu_bytes() -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or 0))
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            if p.pid == os.getpid():
                return int(p.usedGpuMemory)
    except Exception:
        return None
    return None


def _host_kib(field: str) -> int:
    """This process's host memory from /proc/self/status (VmRSS now, VmHWM its peak), in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _log_host_memory(row_id: str, where: dict[str, str]) -> None:
    """Every 2 s, the row's host RSS and stage to $MEMOPT_ZOO_HOST_LOG: a row the kernel kills for host memory
    leaves no JSON line, and this log says how far it got."""
    import threading

    path = os.environ.get("MEMOPT_ZOO_HOST_LOG")
    if not path:
        return
    start = time.perf_counter()

    def loop() -> None:
        while True:
            with open(path, "a") as f:
                f.write(json.dumps({"id": row_id, "t_s": round(time.perf_counter() - start, 1),
                                    "stage": where["stage"], "rss_gib": round(_host_kib("VmRSS") / 2**20, 2),
                                    "hwm_gib": round(_host_kib("VmHWM") / 2**20, 2)}) + "\n")
            time.sleep(2)

    threading.Thread(target=loop, daemon=True).start()


def run_row(row: ZooRow, steps: int) -> dict[str, Any]:
    import torch

    import memopt
    from memopt.units import parse_budget

    out: dict[str, Any] = {"id": row.id, "kind": row.kind, "model_type": row.model_type, "fidelity": row.fidelity,
                           "batch_size": row.batch_size, "seq_len": row.seq_len, "budget": row.budget,
                           "crashed": False, "first_try_oom": False}
    total = torch.cuda.get_device_properties(0).total_memory
    out["budget_bytes"] = parse_budget(row.budget, device_total_bytes=total) if "%" in row.budget \
        else parse_budget(row.budget)
    stage = "build"
    where = {"stage": stage}
    _log_host_memory(row.id, where)
    try:
        t0 = time.perf_counter()
        model, batch, calls = user_loop(row)
        out["num_params"] = sum(p.numel() for p in model.parameters())
        out["build_s"] = time.perf_counter() - t0
        stage = where["stage"] = "wrap"
        t_wrap = time.perf_counter()
        lr = {} if "optimizer" in calls else {"lr": 1e-4}  # a user's own optimizer carries its learning rate
        wrapped = memopt.wrap(model, budget=row.budget, sample=batch, fidelity=row.fidelity, **lr, **calls)
        out["wrap_s"] = time.perf_counter() - t_wrap
        plan = wrapped.plan
        out["plan"] = plan.strategy.label()
        out["predicted_peak_allocated_bytes"] = int(plan.peak_allocated_bytes)
        out["predicted_peak_reserved_bytes"] = int(plan.peak_reserved_bytes)
        out["predicted_total_bytes"] = int(plan.total_bytes)
        out["predicted_step_s"] = float(plan.step_time_s)
        losses, times, totals, outside = [], [], [], []
        first_reserved = 0
        stage = where["stage"] = "train"
        for i in range(steps):
            if i == 2:
                torch.cuda.synchronize()
                out["first_steps_peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
                first_reserved = int(torch.cuda.max_memory_reserved())
                torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
            t = time.perf_counter()
            losses.append(float(wrapped.step(batch)))
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            if i == 0:
                out["time_to_first_step_end_s"] = out["wrap_s"] + times[0]
                out["startup_s"] = getattr(wrapped, "startup_s", None)  # wrap to the first step's start
                if wrapped.plan.strategy.label() != out["plan"]:
                    out["autotuned_plan"] = wrapped.plan.strategy.label()
                    out["predicted_peak_allocated_bytes"] = int(wrapped.plan.peak_allocated_bytes)
                    out["predicted_peak_reserved_bytes"] = int(wrapped.plan.peak_reserved_bytes)
                    out["predicted_total_bytes"] = int(wrapped.plan.total_bytes)
                    out["predicted_step_s"] = float(wrapped.plan.step_time_s)
            used = _process_gpu_bytes()
            if used is not None:
                totals.append(used)
                outside.append(used - int(torch.cuda.memory_reserved()))
        out["final_plan"] = wrapped.plan.strategy.label()
        out["loss_reduction"] = getattr(getattr(wrapped, "_reduction", None), "mode", None)  # as measured
        out["losses"] = losses
        out["step_s"] = times
        out["measured_step_s"] = statistics.median(times[2:]) if len(times) > 2 else times[-1]
        out["measured_peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
        out["measured_peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
        out["nvml_max_bytes"] = max(totals) if totals else None
        out["measured_outside_allocator_bytes"] = max(outside) if outside else None
        out["measured_total_bytes"] = (max(first_reserved, out["measured_peak_reserved_bytes"]) + max(outside)
                                       if outside else None)
        out["predicted_host_bytes"] = wrapped.plan.prediction.get("host_bytes_per_node")
        out["measured_host_peak_bytes"] = _host_kib("VmHWM") * 1024
        out["autotune_trials"] = getattr(wrapped, "autotune_trials", None)
        wrapped.close()
    except Exception as exc:
        out["crashed"] = True
        out["stage"] = stage
        out["error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
        out["traceback"] = traceback.format_exc()[-3000:]
    stats = torch.cuda.memory_stats()
    out["num_ooms"] = int(stats.get("num_ooms", 0))
    out["num_alloc_retries"] = int(stats.get("num_alloc_retries", 0))
    out["first_try_oom"] = out["num_ooms"] > 0
    pred, meas = out.get("predicted_peak_allocated_bytes"), out.get("measured_peak_allocated_bytes")
    if pred and meas:
        out["allocated_error"] = pred / meas - 1
    return out


# ---------------------------------------------------------------------------------------------------------------
# the pool
# ---------------------------------------------------------------------------------------------------------------

def _run_pool(rows: list[ZooRow], out_file: Path, width: int, deadline_s: float, steps: int,
              gpu_bytes: int) -> None:
    from memopt.units import parse_budget

    start = time.time()
    pending = list(rows)
    running: list[tuple[ZooRow, subprocess.Popen, float, int]] = []
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    while pending or running:
        for r in list(running):
            row, proc, _, _ = r
            if proc.poll() is not None or time.time() - start > deadline_s + 60:  # the run's end: nothing outlives it
                if proc.poll() is None:
                    proc.kill()
                    if not _has_row(out_file, row.id):  # killed while it still ran, not while it shut down
                        with out_file.open("a") as f:
                            f.write(json.dumps({"id": row.id, "crashed": True, "error": "timed out"}) + "\n")
                elif proc.returncode != 0 and not _has_row(out_file, row.id):  # killed before it could write
                    with out_file.open("a") as f:
                        f.write(json.dumps({"id": row.id, "crashed": True, "budget": row.budget,
                                            "error": f"the row's process ended with {proc.returncode}"
                                            + (" (SIGKILL: most likely the host's out-of-memory killer)"
                                               if proc.returncode == -9 else "")}) + "\n")
                running.remove(r)
                print(f"[{time.time() - start:5.0f}s] done {row.id} rc={proc.returncode}", flush=True)
        used = sum(b for *_, b in running)
        while pending and len(running) < width and time.time() - start < deadline_s:
            row = pending[0]
            b = parse_budget(row.budget) if "%" not in row.budget else gpu_bytes
            if running and used + b > gpu_bytes:
                break
            pending.pop(0)
            proc = subprocess.Popen([sys.executable, __file__, "row", row.id, "--out", str(out_file),
                                     "--steps", str(steps)], env=env)
            running.append((row, proc, time.time(), b))
            used += b
            print(f"[{time.time() - start:5.0f}s] start {row.id}", flush=True)
        if time.time() - start > deadline_s and not running:
            break
        time.sleep(0.5)
    for row in pending:
        print(f"not run (deadline): {row.id}", flush=True)


def _has_row(out_file: Path, row_id: str) -> bool:
    if not out_file.exists():
        return False
    return any(json.loads(x).get("id") == row_id for x in out_file.read_text().splitlines() if x.strip())


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:+.1f}%"


def report(paths: list[Path], out: Path, device: str = "H200") -> None:
    latest: dict[str, dict[str, Any]] = {}  # a row measured again in a later file replaces the earlier one
    for p in paths:
        for x in p.read_text().splitlines():
            if x.strip():
                r = json.loads(x)
                earlier = latest.get(r["id"])
                if r.get("crashed") and earlier and earlier["source"] == p.name and not earlier.get("crashed"):
                    continue  # the pool's deadline record of a row that had already written its measurement
                latest.pop(r["id"], None)
                latest[r["id"]] = {**r, "source": p.name}
    rows = list(latest.values())
    errs = [abs(r["allocated_error"]) for r in rows if r.get("allocated_error") is not None]
    lines = ["| row | params | plan | predicted alloc | measured alloc | error | total / budget | first-try OOM "
             "| crashed | pred step s | meas step s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gib = 2 ** 30
        share = (r["measured_total_bytes"] / r["budget_bytes"]) if r.get("measured_total_bytes") else None
        lines.append(
            f"| {r['id']} | {r.get('num_params', 0) / 1e9:.2f}B | {r.get('final_plan', r.get('error', ''))[:70]} "
            f"| {r.get('predicted_peak_allocated_bytes', 0) / gib:.2f} GiB "
            f"| {r.get('measured_peak_allocated_bytes', 0) / gib:.2f} GiB | {_pct(r.get('allocated_error'))} "
            f"| {'n/a' if share is None else f'{100 * share:.1f}%'} | {r.get('first_try_oom')} | {r.get('crashed')} "
            f"| {r.get('predicted_step_s', 0):.3f} | {r.get('measured_step_s', 0):.3f} |")
    summary = {"rows": len(rows), "crashed": sum(bool(r.get("crashed")) for r in rows),
               "first_try_oom": sum(bool(r.get("first_try_oom")) for r in rows),
               "over_budget": sum(1 for r in rows if r.get("measured_total_bytes")
                                  and r["measured_total_bytes"] > r["budget_bytes"]),
               "allocated_error_median": statistics.median(errs) if errs else None,
               "allocated_error_max": max(errs) if errs else None}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    title = f"# memopt.wrap on unseen models ({device})\n"
    out.with_suffix(".md").write_text("\n".join([title, json.dumps(summary), "", *lines, ""]))
    print(json.dumps(summary))


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--rows", default="")
    r.add_argument("--width", type=int, default=3)
    r.add_argument("--deadline-s", type=float, default=540)
    r.add_argument("--steps", type=int, default=6)
    r.add_argument("--gpu-fraction", type=float, default=0.92, help="share of the GPU the rows' budgets may fill")
    r.add_argument("--skip", default="", help="rows to leave out")
    one = sub.add_parser("row")
    one.add_argument("id")
    one.add_argument("--out", required=True)
    one.add_argument("--steps", type=int, default=6)
    rep = sub.add_parser("report")
    rep.add_argument("paths", nargs="+")
    rep.add_argument("--out", required=True)
    rep.add_argument("--device", default="H200", help="the GPU the rows ran on, for the table's title")
    sub.add_parser("list")
    args = ap.parse_args()
    if args.cmd == "list":
        for row in ROWS:
            print(row.id)
        return 0
    if args.cmd == "report":
        report([Path(p) for p in args.paths], Path(args.out), args.device)
        return 0
    if args.cmd == "row":
        row = next(x for x in ROWS if x.id == args.id)
        res = run_row(row, args.steps)
        with Path(args.out).open("a") as f:
            f.write(json.dumps(res) + "\n")
        shown = ("id", "final_plan", "loss_reduction", "allocated_error", "first_try_oom", "crashed", "error",
                 "time_to_first_step_end_s")
        print(json.dumps({k: res.get(k) for k in shown}), flush=True)
        return 0
    import torch

    wanted = [x for x in args.rows.split(",") if x]
    skipped = {x for x in args.skip.split(",") if x}
    rows = [x for x in ROWS if (not wanted or x.id in wanted) and x.id not in skipped]
    gpu_bytes = int(torch.cuda.get_device_properties(0).total_memory * args.gpu_fraction)
    _run_pool(rows, Path(args.out), args.width, args.deadline_s, args.steps, gpu_bytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
