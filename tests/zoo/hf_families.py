"""Tiny instances of transformers' architecture families, one per (task, model_type), built from config only.

``FAMILIES`` lists the families in the zoo, each with the config overrides that make it tiny (a few thousand
to a few hundred thousand parameters) and the technique its equivalence check runs under; techniques are
spread so that every technique meets every kind of block (decoder, encoder, encoder-decoder, MoE, vision).
``NOT_IN_ZOO`` names families of the six auto mappings that are kept out, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

TASKS = ("causal_lm", "seq2seq_lm", "masked_lm", "sequence_classification", "token_classification",
         "image_classification")
_AUTO = {"causal_lm": "AutoModelForCausalLM", "seq2seq_lm": "AutoModelForSeq2SeqLM",
         "masked_lm": "AutoModelForMaskedLM", "sequence_classification": "AutoModelForSequenceClassification",
         "token_classification": "AutoModelForTokenClassification",
         "image_classification": "AutoModelForImageClassification"}

DECODER = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
               intermediate_size=64, vocab_size=128, max_position_embeddings=64, head_dim=16, pad_token_id=0)
ENCODER = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64, vocab_size=128,
               max_position_embeddings=64, pad_token_id=0)
GPT2 = dict(n_embd=32, n_layer=3, n_head=2, vocab_size=128, n_positions=64, pad_token_id=0)
BART = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
            encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=128, max_position_embeddings=64)
T5 = dict(d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2, vocab_size=128,
          decoder_start_token_id=0)
VIT = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64, image_size=32,
           patch_size=8, num_labels=3)


@dataclass(frozen=True)
class Family:
    task: str
    model_type: str
    overrides: dict[str, Any]
    technique: str  # the equivalence check's technique (see test_zoo.TECHNIQUES)
    seq_len: int = 16
    image_size: int = 32
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.task}:{self.model_type}"

    def sample(self, batch_size: int = 4) -> dict[str, int]:
        if self.task == "image_classification":
            return {"batch_size": batch_size, "image_size": self.image_size}
        if self.task == "seq2seq_lm":
            return {"batch_size": batch_size, "seq_len": self.seq_len, "decoder_seq_len": 8}
        return {"batch_size": batch_size, "seq_len": self.seq_len}

    def build(self, seed: int = 0) -> nn.Module:
        import transformers

        config = transformers.AutoConfig.for_model(self.model_type, **self.overrides)
        for name in list(vars(config)):  # no dropout, no stochastic depth: the checks compare runs step by step
            if "drop" in name and isinstance(getattr(config, name), float):
                setattr(config, name, 0.0)
        if self.task in ("sequence_classification", "token_classification"):
            config.num_labels = 3
        torch.manual_seed(seed)
        model = getattr(transformers, _AUTO[self.task]).from_config(config)
        model.train()
        return model


def _f(task: str, model_type: str, overrides: dict[str, Any], technique: str, **kw: Any) -> Family:
    return Family(task=task, model_type=model_type, overrides=overrides, technique=technique, **kw)


FAMILIES: list[Family] = [
    # causal LM: decoder blocks (dense and MoE), with each head structure chunked CE meets
    _f("causal_lm", "llama", DECODER, "chunked_ce"),
    _f("causal_lm", "gpt2", GPT2, "full"),
    _f("causal_lm", "mistral", DECODER, "selective"),
    _f("causal_lm", "qwen2", DECODER, "partial"),
    _f("causal_lm", "qwen3", DECODER, "micro_batch"),
    _f("causal_lm", "gemma", DECODER, "offload"),
    _f("causal_lm", "gemma2", {**DECODER, "final_logit_softcapping": 30.0}, "bf16",
       notes="softcapped head: the fused losses apply the softcap"),
    _f("causal_lm", "phi3", DECODER, "full"),
    _f("causal_lm", "opt", dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, ffn_dim=64,
                                vocab_size=128, max_position_embeddings=64, word_embed_proj_dim=32),
       "micro_batch"),
    _f("causal_lm", "gpt_neox", DECODER, "selective"),
    _f("causal_lm", "falcon", {**{k: v for k, v in DECODER.items() if k != "head_dim"},
                               "new_decoder_architecture": True, "num_kv_heads": 2}, "partial"),
    _f("causal_lm", "bloom", dict(hidden_size=32, n_layer=3, n_head=2, vocab_size=128), "offload"),
    _f("causal_lm", "granite", {**DECODER, "logits_scaling": 4.0}, "chunked_ce",
       notes="scaled logits: memopt's chunked loss scales them, Liger's is refused"),
    _f("causal_lm", "qwen2_moe", {**DECODER, "num_experts": 4, "num_experts_per_tok": 2,
                                  "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32},
       "full"),
    _f("causal_lm", "mixtral", {**DECODER, "num_local_experts": 4, "num_experts_per_tok": 2}, "micro_batch"),
    # seq2seq LM: encoder-decoder stacks (two block stacks, cross-attention, T5's shared position bias)
    _f("seq2seq_lm", "t5", T5, "full"),
    _f("seq2seq_lm", "bart", BART, "partial"),
    _f("seq2seq_lm", "mbart", BART, "micro_batch"),
    _f("seq2seq_lm", "pegasus", BART, "offload"),
    # masked LM: encoder blocks
    _f("masked_lm", "bert", ENCODER, "full"),
    _f("masked_lm", "roberta", {**ENCODER, "max_position_embeddings": 66}, "selective"),
    _f("masked_lm", "distilbert", dict(dim=32, n_layers=3, n_heads=2, hidden_dim=64, vocab_size=128,
                                       max_position_embeddings=64), "micro_batch"),
    _f("masked_lm", "albert", {**ENCODER, "embedding_size": 16}, "offload",
       notes="one shared layer: no repeated blocks to checkpoint"),
    _f("masked_lm", "electra", {**ENCODER, "embedding_size": 32}, "partial"),
    # sequence / token classification heads on encoders and decoders
    _f("sequence_classification", "bert", ENCODER, "micro_batch"),
    _f("sequence_classification", "gpt2", GPT2, "full"),
    _f("sequence_classification", "llama", DECODER, "offload"),
    _f("token_classification", "bert", ENCODER, "selective"),
    _f("token_classification", "roberta", {**ENCODER, "max_position_embeddings": 66}, "micro_batch"),
    # image classification: patch transformers and convolutional stages
    _f("image_classification", "vit", VIT, "full"),
    _f("image_classification", "beit", VIT, "micro_batch"),
    _f("image_classification", "dinov2", VIT, "partial"),
    _f("image_classification", "convnext", dict(hidden_sizes=[8, 16], depths=[1, 2], num_stages=2, num_labels=3,
                                                    image_size=32),
       "offload"),
    _f("image_classification", "resnet", dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 2],
                                              num_labels=3), "full", notes="BatchNorm: micro-batching not exact"),
]

# families of the six mappings kept out of the CPU zoo, by reason (others are simply not added yet)
NOT_IN_ZOO: dict[str, str] = {
    "image_classification:timm_wrapper": "needs the timm package and a timm model name",
    "seq2seq_lm:encoder-decoder": "a composite of two other configs, covered by its parts",
}


def families_by_task() -> dict[str, set[str]]:
    """model_type of every family transformers' auto mappings list, per task."""
    from transformers.models.auto import modeling_auto

    from memopt.models.hf_task import HF_TASKS

    return {task: set(getattr(modeling_auto, HF_TASKS[task])) for task in TASKS}
