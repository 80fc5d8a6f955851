"""A training batch's shapes read and checked: the shapes a ``SampleSpec`` is made of, from a dict of shapes or a
real (or fake-tensor) batch, with every problem named at once."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from memopt.models.build import fixes_resolution
from memopt.models.spec import LABEL_KINDS, SAMPLE_KEYS, ModelSpec

__all__ = ["BATCH_KEYS", "collate_rows", "image_sides", "is_pos_int", "is_sequence", "shape_of", "shape_problems",
           "shapes_from_batch"]

#: Batch keys :meth:`SampleSpec.parse` reads shapes from.
BATCH_KEYS: tuple[str, ...] = (
    "input_ids",
    "inputs_embeds",
    "labels",
    "shift_labels",
    "attention_mask",
    "token_type_ids",
    "position_ids",
    "pixel_values",
    "decoder_input_ids",
    "decoder_attention_mask",
    "bbox",
    "lang_ids",
)
#: families whose labels are one per sample (class ids, or floats: ``label_kind``), never one per token
_PER_SAMPLE_LABELS = ("sequence_classification", "image_classification")
_TOKEN_KEYS = ("input_ids", "inputs_embeds", "attention_mask", "token_type_ids", "position_ids")
_DECODER_KEYS = ("decoder_input_ids", "decoder_attention_mask")

# Models whose learned absolute position embeddings cap the sequence length: model_type -> hf_config key.
_LEARNED_POSITIONS = {"gpt2": "n_positions", "bert": "max_position_embeddings"}


def is_pos_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def image_sides(size: Any) -> tuple[int, int] | None:
    """(height, width) of an ``image_size``: a side (square images) or a (height, width) pair; None if neither."""
    if is_pos_int(size):
        return size, size
    if isinstance(size, (list, tuple)) and len(size) == 2 and all(is_pos_int(s) for s in size):
        return int(size[0]), int(size[1])
    return None


def shape_problems(shapes: Mapping[str, Any], spec: ModelSpec | None) -> list[str]:
    """Everything wrong with a shape dict (for ``spec`` when given), as messages."""
    problems: list[str] = []
    unknown = sorted(set(shapes) - set(SAMPLE_KEYS))
    if unknown:
        problems.append(f"unknown keys {unknown} (valid keys: {list(SAMPLE_KEYS)})")
    for key in ("batch_size", "seq_len", "image_size", "decoder_seq_len"):
        value = shapes.get(key)
        if value is None or (key == "image_size" and image_sides(value) is not None):
            continue
        if not is_pos_int(value):
            extra = " (a side), or a (height, width) pair of them" if key == "image_size" else ""
            problems.append(f"{key} must be a positive int{extra}, got {value!r}")
    if not isinstance(shapes.get("variable_length", False), bool):
        problems.append(f"variable_length must be true or false, got {shapes['variable_length']!r}")
    kind = shapes.get("label_kind")
    if kind is not None and kind not in LABEL_KINDS:
        problems.append(f"label_kind must be one of {list(LABEL_KINDS)} (or left out: class ids), got {kind!r}")
    elif kind is not None and spec is not None and spec.family not in _PER_SAMPLE_LABELS:
        problems.append(f"label_kind={kind!r} applies to sequence and image classifiers, not {spec.family} "
                        f"{spec.name!r}")
    if shapes.get("batch_size") is None:
        problems.append("batch_size is required")
    seq_len, image_size = shapes.get("seq_len"), shapes.get("image_size")
    if spec is None:
        if seq_len is None and image_size is None:
            problems.append("one of seq_len (token models) or image_size (image models) is required")
        elif seq_len is not None and image_size is not None:
            problems.append("give seq_len (token models) or image_size (image models), not both")
        if image_size is not None and shapes.get("decoder_seq_len") is not None:
            problems.append("decoder_seq_len applies to seq2seq token models, not to images")
        return problems
    hf = spec.hf_config
    if spec.is_token_model:
        if seq_len is None:
            problems.append(f"seq_len is required for {spec.family} model {spec.name!r}")
        if image_size is not None:
            problems.append(f"image_size does not apply to {spec.family} model {spec.name!r} (use seq_len)")
        if shapes.get("decoder_seq_len") is not None and spec.family != "seq2seq_lm":
            problems.append(f"decoder_seq_len applies to seq2seq_lm models only, not {spec.family} {spec.name!r}")
        limit_key = _LEARNED_POSITIONS.get(spec.model_type)
        limit = hf.get(limit_key) if limit_key else None
        if is_pos_int(seq_len) and is_pos_int(limit) and seq_len > limit:
            problems.append(
                f"seq_len {seq_len} exceeds {spec.name!r}'s learned position embeddings ({limit_key}={limit})"
            )
    else:
        if image_size is None:
            problems.append(f"image_size is required for image model {spec.name!r}")
        for key in ("seq_len", "decoder_seq_len"):
            if shapes.get(key) is not None:
                problems.append(f"{key} does not apply to image model {spec.name!r} (use image_size)")
        given, model_sides = image_sides(image_size), image_sides(hf.get("image_size"))
        if given is not None and model_sides is not None and given != model_sides and fixes_resolution(spec):
            problems.append(
                f"image_size {image_size} differs from {spec.name!r}'s image_size {hf.get('image_size')} (its "
                "position embeddings fix the resolution; override hf_config image_size to plan another one)"
            )
    return problems


def shape_of(value: Any) -> tuple[int, ...] | None:
    shape = getattr(value, "shape", None)
    return tuple(int(d) for d in shape) if shape is not None else None


def _sequence_lengths(value: Sequence[Any], key: str, problems: list[str]) -> list[int]:
    """Lengths of a list of 1-D sequences (tensors or lists of ints)."""
    lengths: list[int] = []
    for i, seq in enumerate(value):
        shape = shape_of(seq)
        if shape is not None:
            if len(shape) != 1:
                problems.append(f"{key}[{i}] must be 1-D (one sequence), got shape {list(shape)}")
                continue
            lengths.append(shape[0])
        elif isinstance(seq, Sequence) and not isinstance(seq, (str, bytes)):
            lengths.append(len(seq))
        else:
            problems.append(f"{key}[{i}] is not a sequence (got {type(seq).__name__})")
    return lengths


def collate_rows(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """A list of per-example dicts (as a dataset yields them) -> a dict of per-key lists."""
    keys: list[str] = []
    for row in rows:
        keys.extend(k for k in row if k not in keys)
    return {k: [row[k] for row in rows if k in row] for k in keys}


def _label_kind(labels: Any) -> str | None:
    """What a classifier's ``labels`` hold: float labels with a column per class are ``multi_label`` (a 0/1 per
    class, ``problem_type="multi_label_classification"``), float labels one a sample (``(batch,)`` or
    ``(batch, 1)``) are ``regression`` targets; class ids (integers) are None."""
    shape = shape_of(labels)
    if shape is None or not getattr(labels, "is_floating_point", lambda: False)():
        return None
    return "multi_label" if len(shape) == 2 and shape[1] > 1 else "regression"


def shapes_from_batch(batch: Mapping[str, Any], spec: ModelSpec | None) -> tuple[dict[str, Any], list[str]]:
    """Read sample shapes from a real (or fake-tensor) batch; returns (shapes, problems). A classifier's labels
    (``spec`` of a sequence or image classification family) are per sample: what they hold is ``label_kind``."""
    problems: list[str] = []
    unknown = sorted(set(batch) - set(BATCH_KEYS))
    if unknown:
        problems.append(f"unknown batch keys {unknown} (valid keys: {list(BATCH_KEYS)})")
    dims: dict[str, tuple[int, ...]] = {}  # key -> (batch, length, ...) as planned
    variable = False
    for key, value in batch.items():
        if key in unknown:
            continue
        shape = shape_of(value)
        if shape is not None:
            if len(shape) == 0:
                problems.append(f"{key} must have a batch dimension, got a scalar")
                continue
            dims[key] = shape
        elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            lengths = _sequence_lengths(value, key, problems)
            if not lengths:
                problems.append(f"{key} is an empty list of sequences")
                continue
            variable = True
            dims[key] = (len(lengths), max(lengths))
        else:
            problems.append(f"{key} must be a tensor or a list of sequences, got {type(value).__name__}")
    batch_sizes = {k: s[0] for k, s in dims.items()}
    if len(set(batch_sizes.values())) > 1:
        problems.append(f"batch sizes disagree across keys: {batch_sizes}")
    shapes: dict[str, Any] = {"batch_size": max(batch_sizes.values()) if batch_sizes else None}
    if variable:
        shapes["variable_length"] = True
    per_sample_labels = spec is not None and spec.family in _PER_SAMPLE_LABELS
    if per_sample_labels and _label_kind(batch.get("labels")) is not None:
        shapes["label_kind"] = _label_kind(batch.get("labels"))

    is_image = "pixel_values" in dims or (spec is not None and not spec.is_token_model)
    if is_image:
        pixels = dims.get("pixel_values")
        if pixels is None:
            problems.append("an image batch needs pixel_values of shape (batch, channels, height, width)")
        elif len(pixels) != 4:
            problems.append(f"pixel_values must be (batch, channels, height, width), got shape {list(pixels)}")
        else:  # a side, or (height, width) for rectangular images
            shapes["image_size"] = pixels[2] if pixels[2] == pixels[3] else [pixels[2], pixels[3]]
        token_keys = sorted(k for k in dims if k in _TOKEN_KEYS or k in _DECODER_KEYS)
        if token_keys:
            problems.append(f"an image batch takes pixel_values and labels, not {token_keys}")
        return shapes, problems

    source = next((k for k in ("input_ids", "inputs_embeds") if k in dims), None)
    if source is None:
        problems.append("a token batch needs input_ids (or inputs_embeds); an image batch needs pixel_values")
        return shapes, problems
    seq_len = dims[source][1] if len(dims[source]) >= 2 else None
    if seq_len is None:
        problems.append(f"{source} must be (batch, seq_len{', hidden' if source == 'inputs_embeds' else ''})")
    shapes["seq_len"] = seq_len
    seq2seq = any(k in dims for k in _DECODER_KEYS) or (spec is not None and spec.family == "seq2seq_lm")
    for key in _TOKEN_KEYS:
        if key in dims and key != source and len(dims[key]) >= 2 and dims[key][1] != seq_len:
            problems.append(f"{key} has length {dims[key][1]} but {source} has {seq_len}")
    decoder_keys = [k for k in (*_DECODER_KEYS, "labels", "shift_labels") if k in dims and len(dims[k]) >= 2
                    and not (k == "labels" and per_sample_labels)]
    if seq2seq:
        lengths = {k: dims[k][1] for k in decoder_keys}
        if len(set(lengths.values())) > 1:
            problems.append(f"decoder lengths disagree: {lengths}")
        shapes["decoder_seq_len"] = max(lengths.values()) if lengths else seq_len
    else:
        for key in decoder_keys:
            if dims[key][1] != seq_len:
                if spec is None and key == "labels":  # no spec: labels of another length mean an encoder-decoder
                    shapes["decoder_seq_len"] = dims[key][1]
                else:
                    problems.append(f"{key} has length {dims[key][1]} but {source} has {seq_len}")
    return shapes, problems


def is_sequence(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))
