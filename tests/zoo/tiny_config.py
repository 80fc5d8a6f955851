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
             "lru_width", "audio_hidden_size", "cross_attention_hidden_size", "out_hidden_size", "n_embed",
             "adapter_in_dim", "adapter_out_dim", "adapter_input_size", "nemo_conv_channels", "ext_pw_out_channel",
             "depthwise_separable_out_channel")),
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
               "d_rel", "time_step_rank", "mamba_dt_rank", "dim_bbox_projection")),
    (8, ("qk_rope_head_dim", "patch_size", "hidden_size_per_layer_input", "laurel_rank", "local_attention",
        "sliding_window", "attention_window", "window_size", "chunk_size", "mamba_chunk_size", "block_size",
        "local_attn_chunk_length", "lsh_attn_chunk_length", "attention_chunk_size", "sliding_window_size",
        "local_attention_window_len", "global_block_size", "local_radius", "num_latents", "d_rel")),
    (VOCAB, ("vocab_size", "vocab_size_per_layer_input", "decoder_vocab_size", "entity_vocab_size",
            "src_vocab_size", "tgt_vocab_size", "char_vocab_size", "pronunciation_vocab_size", "shape_vocab_size",
            "unpadded_vocab_size", "audio_vocab_size", "num_buckets", "num_hash_buckets",
            "encoder_hash_byte_group_vocab")),
    (POSITIONS, ("max_position_embeddings", "n_positions", "n_ctx", "max_source_positions", "max_target_positions",
                "max_seq_len", "max_2d_position_embeddings", "max_encoder_position_embeddings",
                "max_decoder_position_embeddings", "original_max_position_embeddings", "model_max_length",
                "max_length", "context_length", "max_seq_length")),
    (IMAGE, ("image_size",)),
    (2, ("num_groups",)),  # group norm's groups divide the narrowest width (8)
    (4, ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")),
    (2, ("num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token")),
    (1, ("n_group", "topk_group", "num_expert_group", "n_shared_experts", "num_shared_experts",
        "moe_num_shared_experts", "first_k_dense_replace", "num_dense_layers", "max_window_layers", "n_groups",
        "mamba_n_groups", "mamba_ngroups")),
]
_SIZE_OF = {name: size for size, names in _SIZES for name in names}
_LAYER_NAMES = _SIZES[2][1]
# counts that keep a smaller default (a model with one expert per token stays so)
_CLAMPED = {name for size, names in _SIZES[-4:] for name in names}
# sizes that some config classes leave unset (None) for a checkpoint to give, and whose model reads them as
# given (``head_dim ** -0.5``, ``heads // num_key_value_heads``, ``nn.Embedding(vocab_size, ...)``); the tiny
# values are what the other fields imply (HIDDEN // HEADS, HEADS)
_UNSET_SIZES = ("head_dim", "num_key_value_heads", "vocab_size")
# the expert counts a mixture-of-experts config (one with an expert width) may leave unset for a checkpoint to give
# (its model builds ``num_local_experts`` experts, routes each token to ``num_experts_per_tok`` and sizes its shared
# expert ``moe_intermediate_size * n_shared_experts``)
_UNSET_EXPERT_COUNTS = ("n_routed_experts", "num_local_experts", "num_experts_per_tok", "n_shared_experts")
# compound-scaling coefficients of a scaled family (EfficientNet's B0-B7 scale the base widths and depths): the
# tiny model is a quarter of the base model's widths, one block a stage
_SCALING = {"width_coefficient": 0.25, "depth_coefficient": 0.25}
# per-stage lists of convolutional / hierarchical vision backbones: widths double per stage, one block a stage,
# one head a stage
_STAGE_WIDTHS = ("hidden_sizes", "embed_dims", "embed_dim", "neck_hidden_sizes", "stage_out_channels",
                 "stage_mid_channels", "stage_in_channels", "stem_channels")
_STAGE_ONES = ("depths", "num_heads", "num_attention_heads", "depth", "stage_num_blocks", "num_block_repeats",
               "block_repeats", "n_attn_blocks", "stage_numb_of_layers")

#: what a family needs beyond the name rules (model_type -> fields set after shrinking, a dotted key for a
#: sub-config's field)
OVERRIDES: dict[str, dict[str, Any]] = {
    # the sliding-window layers' query head is head_dim wide (qk_nope_head_dim + qk_rope_head_dim, their own
    # no-rope part in per_layer_config: HEAD_DIM + 8), the indexed layers' rope part is head_dim for others' MLA
    "dots3_note_text": {"head_dim": HEAD_DIM + 8},
    "dots3_note": {"text_config.head_dim": HEAD_DIM + 8},
    # the stem is four stride-2 convolutions whatever patch_size says, and the attention biases are sized by
    # image_size // patch_size: the two must agree
    "levit": {"patch_size": 16},
    # the masked-LM decoder has one query per position: its logits are max_position_embeddings long, and the
    # labels the input's length (the zoo's seq_len, 16)
    "perceiver": {"max_position_embeddings": 16},
    # its transformer blocks unfold the feature map into patch_size patches: the last stage's map of a 64-pixel
    # image is 4x4, so the default 2 stays (the name rule's 8 is a ViT's patch)
    "mobilevitv2": {"patch_size": 2},
    # it reads an image as one token a pixel: the zoo's 64-pixel images are 4096 positions
    "imagegpt": {"n_positions": IMAGE * IMAGE},
    # axial position embeddings: their widths add up to the hidden size, and in training the sequence is exactly
    # the product of the axial shape (the zoo's seq_len, 16)
    # the default leaves the indexed-attention layers' query-sparse indexer unset (a checkpoint gives it) although
    # its layer_types name such layers
    **{key: {f"{prefix}indexer_{name}": value for name, value in
             {"n_heads": HEADS, "kv_heads": 1, "head_dim": HEAD_DIM, "budget": 8, "compress_ratio": 4}.items()}
       for key, prefix in (("qwen4_exp_text", ""), ("qwen4_exp", "text_config."))},
    # the hybrid layers share one transformer, tied from the first to the others: it takes two of them
    "zamba": {"layers_block_type": ["linear_attention", "hybrid", "hybrid"]},
    # the attention layers read their sub-config's rope_theta, which the sub-config class does not define (the
    # rotary embedding itself reads the top-level rope_parameters), and clamp q, k, v to clip_qkv, whose default
    # (None) torch's clamp refuses (the released checkpoints clip at 8)
    "dbrx": {"attn_config.rope_theta": 10000.0, "attn_config.clip_qkv": 8.0},
    # the config class leaves layer_types to a checkpoint (its model reads layer_types[i]; Lfm2's class derives
    # them from full_attn_idxs): one convolution layer, one attention layer
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # the layout embeddings concatenate six 2-D position embeddings (x0, y0, x1, y1 of coordinate_size, h, w of
    # shape_size; LiLT's each hidden_size // 6) into the hidden size: it is a multiple of 6 (48), and theirs add up
    "lilt": {"hidden_size": 48},
    "layoutlmv3": {"hidden_size": 48, "coordinate_size": 8, "shape_size": 8},
    # each stage's stochastic depth rates are indexed by the stage's number: stage i has more than i blocks
    "cvt": {"depth": [1, 2, 3]},
    # the sliding-window layers have twice the key/value heads of the others: still no more than the query heads
    "mimo_v2_flash": {"num_key_value_heads": 1},
    "reformer": {"axial_pos_embds_dim": [HIDDEN // 2, HIDDEN // 2], "axial_pos_shape": [4, 4]},
}


def _kept_layers(d: dict[str, Any], layers_before: int | None) -> list[int]:
    """The original layers the tiny config keeps: the first ``LAYERS``, and the first layer of every kind a
    per-layer list names that those miss (a model with sliding and full attention layers keeps one of each: some
    refuse a config without a full-attention layer); where the last ``num_kv_shared_layers`` reuse earlier layers'
    keys and values, the same again among those (each kind they reuse must be among the earlier ones)."""
    if not layers_before or layers_before <= LAYERS:
        return list(range(LAYERS))  # (a shallower default grows to LAYERS; its per-layer lists stay)
    kinds = [v for v in d.values()
             if isinstance(v, list) and len(v) == layers_before and all(isinstance(k, str) for k in v)]
    shared = d.get("num_kv_shared_layers")
    split = layers_before - shared if isinstance(shared, int) and 0 < shared < layers_before else layers_before
    keep: list[int] = []
    for start, stop in ((0, split), (split, layers_before)):
        part = list(range(start, min(stop, start + LAYERS)))
        for value in kinds:
            for i in range(start, stop):
                if value[i] not in {value[j] for j in part}:
                    part.append(i)
        keep += part[:4]
    return sorted(keep)


def _per_layer_dict(value: Any, layers_before: int | None) -> bool:
    """A dict keyed by layer index (``per_layer_config``: ``{"05": {"head_dim": 512}, ...}``)."""
    return (isinstance(value, dict) and bool(value) and (layers_before or 0) > LAYERS
            and all(str(k).isdigit() and int(k) < layers_before for k in value))


def _shrink_list(key: str, value: list[Any], layers_before: int | None, keep: list[int]) -> list[Any]:
    if layers_before and len(value) == layers_before and layers_before > LAYERS:
        if key in _SIZE_OF and all(isinstance(v, int) for v in value):  # a per-layer width
            return [_SIZE_OF[key]] * len(keep)
        return [value[i] for i in keep]  # a per-layer list (layer_types, mlp_only_layers, ...) follows the new depth
    if (layers_before and layers_before > LAYERS and ("layer" in key or "idx" in key)
            and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < layers_before for v in value)
            and any(v in keep for v in value)):  # layer indices of a kind the kept layers have (hybrid_layer_ids):
        return [keep.index(v) for v in value if v in keep]  # the kept ones, renumbered
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
    keep = _kept_layers(d, layers_before)
    for key, value in d.items():
        if value is None and key in _UNSET_SIZES:
            out[key] = _SIZE_OF[key]
        if isinstance(value, bool) or value is None:
            continue
        if _per_layer_dict(value, layers_before):  # the kept layers' entries, renumbered and shrunk
            width = len(str(next(iter(value))))
            out[key] = {type(k)(str(new).zfill(width)): shrink(value[k], vocab) if isinstance(value[k], dict)
                        else value[k] for new, i in enumerate(keep) for k in value if int(k) == i}
        elif isinstance(value, dict):
            is_sub = "model_type" in value or key.endswith(("_config", "encoder", "decoder"))
            out[key] = shrink(value, vocab) if is_sub else value
        elif isinstance(value, int) and key in _LAYER_NAMES:
            out[key] = len(keep) if value == layers_before and value > LAYERS else LAYERS
        elif key == "num_kv_shared_layers" and isinstance(value, int) and (layers_before or 0) > LAYERS:
            out[key] = len(keep) if value == layers_before else sum(i >= layers_before - value for i in keep)
        elif isinstance(value, int) and key in _SIZE_OF:
            out[key] = min(value, _SIZE_OF[key]) if key in _CLAMPED else _SIZE_OF[key]
        elif isinstance(value, list):
            out[key] = _shrink_list(key, value, layers_before, keep)
        elif isinstance(value, float) and key in _SCALING:  # compound scaling: below the base model's widths
            out[key] = _SCALING[key]
        elif isinstance(value, float) and ("drop" in key or key in ("attention_probs_dropout_prob",)):
            out[key] = 0.0
    if isinstance(out.get("moe_intermediate_size"), int):
        for key in _UNSET_EXPERT_COUNTS:
            if key in out and out[key] is None:
                out[key] = _SIZE_OF[key]
    if "qk_nope_head_dim" in out and "qk_rope_head_dim" in out and "qk_head_dim" in out:
        out["qk_head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    if "qk_rope_head_dim" in out and "head_dim" in out:  # multi-head latent attention ropes qk_rope_head_dim
        out["head_dim"] = out["qk_rope_head_dim"]
        rope = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
        partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor"))
        if isinstance(partial, float) and 0 < partial < 1 and isinstance(d["head_dim"], int) and isinstance(
                d["qk_rope_head_dim"], int) and d["head_dim"] * partial == d["qk_rope_head_dim"]:
            out["head_dim"] = round(out["qk_rope_head_dim"] / partial)  # the rope covers part of head_dim
    ratio = d.get("attention_hidden_size"), d.get("hidden_size")  # attention over [hidden, embeddings] (Zamba)
    if all(isinstance(v, int) and v > 0 for v in ratio) and ratio[0] % ratio[1] == 0:
        out["attention_hidden_size"] = out["hidden_size"] * (ratio[0] // ratio[1])
    for expand, heads, head in (("mamba_expand", "mamba_n_heads", "mamba_d_head"), ("expand", "num_heads", "head_dim"),
                                ("mamba_expand", "n_mamba_heads", "mamba_headdim")):
        if all(isinstance(out.get(k), int) for k in (expand, heads, head, "hidden_size")):  # Mamba-2 heads split
            inner = out[expand] * out["hidden_size"]                                     # the expanded width
            out[head] = inner // out[heads]
            if isinstance(out.get("mamba_d_ssm"), int):
                out["mamba_d_ssm"] = inner
    depths = out.get("depths")
    if isinstance(out.get("window_size"), int) and isinstance(out.get("patch_size"), int) and isinstance(
            depths, list) and depths:  # a hierarchical vision model's window fits its last stage's map
        out["window_size"] = min(out["window_size"], max(1, IMAGE // out["patch_size"] // 2 ** (len(depths) - 1)))
    _stage_chain(d, out)
    width = d.get("width_coefficient")
    if isinstance(width, float) and width > 0 and isinstance(d.get("hidden_dim"), int):  # the head's width is
        out["hidden_dim"] = round(d["hidden_dim"] * _SCALING["width_coefficient"] / width)  # scaled as the rest
    _rope_lists(out)
    _token_ids(out, int(out.get("vocab_size") or vocab))
    for key in ("pad_token_id", "decoder_start_token_id"):  # classifiers pool at the padding token, seq2seq
        if key in out and out[key] is None:                  # heads shift labels right from the start token
            out[key] = 0
    return out


def _stage_chain(d: dict[str, Any], out: dict[str, Any]) -> None:
    """A convolutional backbone's stem and stages stay chained after their widths shrink: a stem channel list that
    starts at the image's channels keeps that first entry, a stem width equal to the first stage's width stays so,
    and each stage takes what the one before gives (the stem's output for the first)."""
    stem = out.get("stem_channels")
    if isinstance(stem, list) and len(stem) > 1 and d["stem_channels"][0] == d.get("num_channels"):
        out["stem_channels"] = [d["stem_channels"][0], *(8 * 2**i for i in range(len(stem) - 1))]
    sizes, before = out.get("hidden_sizes"), d.get("hidden_sizes")
    if isinstance(d.get("stem_out_channels"), int) and isinstance(before, list) and before and isinstance(
            sizes, list) and d["stem_out_channels"] == before[0]:
        out["stem_out_channels"] = sizes[0]
    ins, outs = out.get("stage_in_channels"), out.get("stage_out_channels")
    if isinstance(ins, list) and isinstance(outs, list) and len(ins) == len(outs) and ins:
        first = out["stem_channels"][-1] if isinstance(out.get("stem_channels"), list) else ins[0]
        out["stage_in_channels"] = [first, *outs[:-1]]


def _rope_lists(d: dict[str, Any]) -> None:
    """Longrope's per-frequency factors have one entry per rotary pair of the (new) head dim; a config class whose
    default leaves per-layer-type rope parameters empty for a checkpoint to fill (its model reads
    ``rope_parameters[layer_type]``) gets the default rope for each type."""
    if d.get("rope_parameters") == {} and isinstance(d.get("layer_types"), list):
        d["rope_parameters"] = {kind: {"rope_type": "default", "rope_theta": 10000.0}
                                for kind in dict.fromkeys(d["layer_types"])}
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
    if d.get("architectures") is None:  # the auto classes iterate it where a mapping lists several classes
        d["architectures"] = []
    for derived in ("out_features", "out_indices", "stage_names"):  # backbone stage names follow the new depth
        d.pop(derived, None)
    d.pop("id2label", None)
    d.pop("label2id", None)
    return cls.from_dict(d)
