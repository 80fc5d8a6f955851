"""A tiny config for any transformers model type, made from its config class's defaults.

Every size-like field (widths, depths, heads, vocabulary, positions, experts, image and patch sizes) is shrunk by
its name, in the config and in each nested sub-config (``text_config``, ``vision_config``, ``encoder``, ...);
per-layer lists follow the new depth, per-stage lists keep their length, token ids move inside the shrunk
vocabulary, and dropout is off (the zoo compares runs step by step). The names cover the families of the six auto
mappings; :data:`OVERRIDES` holds what a family needs beyond them.
"""

from __future__ import annotations

import copy
from typing import Any

HIDDEN, FFN, LAYERS, HEADS, HEAD_DIM, VOCAB, POSITIONS, IMAGE = 32, 64, 2, 2, 16, 256, 128, 64

# (size, names): a list, as several groups share a size
_SIZES: list[tuple[int, tuple[str, ...]]] = [
    (HIDDEN, ("hidden_size", "d_model", "n_embd", "embed_dim", "dim", "embedding_size", "word_embed_proj_dim",
             "d_latents", "projection_dim", "attention_hidden_size", "hidden_size_global", "pooler_hidden_size",
             "true_hidden_size", "intra_bottleneck_size", "encoder_hidden_size", "decoder_hidden_size",
             "emb_dim", "embedding_dim", "entity_emb_size", "input_embedding_size", "output_embedding_size",
             "lru_width", "audio_hidden_size", "cross_attention_hidden_size", "out_hidden_size", "n_embed")),
    (FFN, ("intermediate_size", "ffn_dim", "d_ff", "encoder_ffn_dim", "decoder_ffn_dim", "n_inner",
          "moe_intermediate_size", "shared_expert_intermediate_size", "shared_experts_intermediate_size",
          "moe_shared_expert_intermediate_size", "hidden_dim", "d_inner", "dim_ff", "ffn_hidden_size",
          "dense_intermediate_size", "intermediate_size_mlp", "feed_forward_size", "expert_ffn_hidden_size",
          "shared_intermediate_size", "dff", "mlp_dim", "decoder_intermediate_size")),
    (LAYERS, ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
             "num_decoder_layers", "num_encoder_layers", "depth", "num_self_attends_per_block")),
    (HEADS, ("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
            "decoder_attention_heads", "num_key_value_heads", "num_kv_heads", "n_kv_heads", "linear_num_key_heads",
            "linear_num_value_heads", "index_n_heads", "swa_num_attention_heads", "swa_num_key_value_heads",
            "num_self_attention_heads", "num_cross_attention_heads", "num_encoder_attention_heads",
            "num_decoder_attention_heads", "attention_heads", "num_query_groups", "multi_query_group_num",
            "mamba_n_heads", "mamba_num_heads", "n_mamba_heads", "linear_num_heads")),
    (HEAD_DIM, ("head_dim", "d_kv", "qk_nope_head_dim", "v_head_dim", "linear_key_head_dim", "linear_value_head_dim",
               "index_head_dim", "swa_head_dim", "dim_head", "d_head", "attention_head_size", "kv_channels",
               "mamba_d_head", "mamba_head_dim", "mamba_headdim", "attention_head_dim", "linear_head_dim",
               "kv_lora_rank", "q_lora_rank", "mamba_d_state", "ssm_state_size", "state_size", "rotary_dim",
               "d_rel", "time_step_rank", "mamba_dt_rank")),
    (8, ("qk_rope_head_dim", "patch_size", "hidden_size_per_layer_input", "laurel_rank", "local_attention",
        "sliding_window", "attention_window", "window_size", "chunk_size", "mamba_chunk_size", "block_size",
        "local_attn_chunk_length", "lsh_attn_chunk_length", "attention_chunk_size", "sliding_window_size",
        "local_attention_window_len", "global_block_size", "local_radius", "num_latents", "d_rel")),
    (VOCAB, ("vocab_size", "vocab_size_per_layer_input", "decoder_vocab_size", "entity_vocab_size",
            "src_vocab_size", "tgt_vocab_size", "char_vocab_size", "pronunciation_vocab_size", "shape_vocab_size",
            "unpadded_vocab_size", "audio_vocab_size", "num_buckets", "num_hash_buckets")),
    (POSITIONS, ("max_position_embeddings", "n_positions", "n_ctx", "max_source_positions", "max_target_positions",
                "max_seq_len", "max_2d_position_embeddings", "max_encoder_position_embeddings",
                "max_decoder_position_embeddings", "original_max_position_embeddings", "model_max_length",
                "max_length", "context_length", "max_seq_length")),
    (IMAGE, ("image_size",)),
    (4, ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")),
    (2, ("num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token")),
    (1, ("n_group", "topk_group", "num_expert_group", "n_shared_experts", "num_shared_experts",
        "moe_num_shared_experts", "first_k_dense_replace", "num_dense_layers", "max_window_layers")),
]
_SIZE_OF = {name: size for size, names in _SIZES for name in names}
_LAYER_NAMES = _SIZES[2][1]
# counts that keep a smaller default (a model with one expert per token stays so)
_CLAMPED = {name for size, names in _SIZES[-3:] for name in names}
# per-stage lists of convolutional / hierarchical vision backbones: widths double per stage, one block a stage,
# one head a stage
_STAGE_WIDTHS = ("hidden_sizes", "embed_dims", "embed_dim", "neck_hidden_sizes", "stage_out_channels",
                 "stage_mid_channels", "stage_in_channels", "stem_channels")
_STAGE_ONES = ("depths", "num_heads", "num_attention_heads", "depth", "stage_num_blocks", "num_block_repeats",
               "block_repeats", "n_attn_blocks", "stage_numb_of_layers")

#: what a family needs beyond the name rules (model_type -> fields set after shrinking, a dotted key for a
#: sub-config's field)
OVERRIDES: dict[str, dict[str, Any]] = {}


def _shrink_list(key: str, value: list[Any], layers_before: int | None) -> list[Any]:
    if layers_before and len(value) == layers_before and layers_before != LAYERS:
        return value[:LAYERS]  # a per-layer list (layer_types, mlp_only_layers, ...) follows the new depth
    if not value or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return value
    if key in _STAGE_WIDTHS:
        return [8 * 2**i for i in range(len(value))]
    if key in _STAGE_ONES:
        return [1] * len(value)
    if key == "image_size":
        return [IMAGE] * len(value)
    return value


def shrink(d: dict[str, Any], vocab: int = VOCAB) -> dict[str, Any]:
    """``d`` (a config's ``to_dict()``) with its sizes shrunk, recursively into sub-config dicts."""
    out = dict(d)
    layers_before = next((d[k] for k in _LAYER_NAMES if isinstance(d.get(k), int)), None)
    for key, value in d.items():
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, dict):
            is_sub = "model_type" in value or key.endswith(("_config", "encoder", "decoder"))
            out[key] = shrink(value, vocab) if is_sub else value
        elif isinstance(value, int) and key in _SIZE_OF:
            out[key] = min(value, _SIZE_OF[key]) if key in _CLAMPED else _SIZE_OF[key]
        elif isinstance(value, list):
            out[key] = _shrink_list(key, value, layers_before)
        elif isinstance(value, float) and ("drop" in key or key in ("attention_probs_dropout_prob",)):
            out[key] = 0.0
    if "qk_nope_head_dim" in out and "qk_rope_head_dim" in out and "qk_head_dim" in out:
        out["qk_head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    if "qk_rope_head_dim" in out and "head_dim" in out:  # multi-head latent attention ropes qk_rope_head_dim
        out["head_dim"] = out["qk_rope_head_dim"]
    _rope_lists(out)
    _token_ids(out, int(out.get("vocab_size") or vocab))
    for key in ("pad_token_id", "decoder_start_token_id"):  # classifiers pool at the padding token, seq2seq
        if key in out and out[key] is None:                  # heads shift labels right from the start token
            out[key] = 0
    return out


def _rope_lists(d: dict[str, Any]) -> None:
    """Longrope's per-frequency factors have one entry per rotary pair of the (new) head dim."""
    for key in ("rope_parameters", "rope_scaling"):
        rope = d.get(key)
        if not isinstance(rope, dict):
            continue
        pairs = int(d.get("head_dim") or HEAD_DIM) // 2
        for name in ("short_factor", "long_factor"):
            if isinstance(rope.get(name), list):
                rope[name] = rope[name][:pairs]
        if "original_max_position_embeddings" in rope:
            rope["original_max_position_embeddings"] = POSITIONS // 2


def _token_ids(d: dict[str, Any], vocab: int) -> None:
    """Special token ids outside the shrunk vocabulary take the top ids, distinct ones apart."""
    moved: dict[int, int] = {}

    def move(v: int) -> int:
        if v < vocab:
            return v
        if v not in moved:
            moved[v] = vocab - 1 - len(moved)
        return moved[v]

    for key, value in d.items():
        if not key.endswith(("token_id", "token_index", "token_ids", "_token")):
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            d[key] = move(value)
        elif isinstance(value, list) and all(isinstance(v, int) for v in value):
            d[key] = [move(v) for v in value]


def tiny_config(model_type: str, num_labels: int = 3) -> Any:
    """The tiny config of ``model_type`` (raises what the config class raises when it cannot be made)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    d = shrink(cls().to_dict())
    d.setdefault("pad_token_id", 0)
    d.setdefault("decoder_start_token_id", 0)
    for key, value in OVERRIDES.get(model_type, {}).items():
        node = d
        *path, last = key.split(".")
        for part in path:
            node = node[part]
        node[last] = copy.deepcopy(value)
    d["num_labels"] = num_labels
    for derived in ("out_features", "out_indices", "stage_names"):  # backbone stage names follow the new depth
        d.pop(derived, None)
    d.pop("id2label", None)
    d.pop("label2id", None)
    return cls.from_dict(d)
