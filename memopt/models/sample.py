"""Training samples: their shapes (:class:`SampleSpec`), random batches that shape (:func:`make_batch`), and the
number of loss-contributing items in a batch (:func:`token_count`).

Batches deliberately carry no ``attention_mask``: for unpadded random data an all-ones mask means the same as no
mask, and without one transformers takes the ``is_causal`` / flash path instead of building a mask tensor. Under
``FakeTensorMode`` a fake mask could not even be inspected to prove it is all ones, so transformers would
materialise a full ``(batch, 1, seq, seq)`` mask that the real run never allocates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from memopt.models.spec import SAMPLE_KEYS, ModelSpec, load_model_spec

__all__ = ["BATCH_KEYS", "MLM_PROBABILITY", "SampleSpec", "config_vocab_size", "expected_token_count", "make_batch",
           "token_count"]

#: Fraction of positions that carry a masked-LM label (BERT's 15%).
MLM_PROBABILITY = 0.15

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
)
_TOKEN_KEYS = ("input_ids", "inputs_embeds", "attention_mask", "token_type_ids", "position_ids")
_DECODER_KEYS = ("decoder_input_ids", "decoder_attention_mask")

# Models whose learned absolute position embeddings cap the sequence length: model_type -> hf_config key.
_LEARNED_POSITIONS = {"gpt2": "n_positions", "bert": "max_position_embeddings"}


def _is_pos_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _shape_problems(shapes: Mapping[str, Any], spec: ModelSpec | None) -> list[str]:
    """Everything wrong with a shape dict (for ``spec`` when given), as messages."""
    problems: list[str] = []
    unknown = sorted(set(shapes) - set(SAMPLE_KEYS))
    if unknown:
        problems.append(f"unknown keys {unknown} (valid keys: {list(SAMPLE_KEYS)})")
    for key in ("batch_size", "seq_len", "image_size", "decoder_seq_len"):
        value = shapes.get(key)
        if value is None:
            continue
        if not _is_pos_int(value):
            problems.append(f"{key} must be a positive int, got {value!r}")
    if not isinstance(shapes.get("variable_length", False), bool):
        problems.append(f"variable_length must be true or false, got {shapes['variable_length']!r}")
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
        if _is_pos_int(seq_len) and _is_pos_int(limit) and seq_len > limit:
            problems.append(
                f"seq_len {seq_len} exceeds {spec.name!r}'s learned position embeddings ({limit_key}={limit})"
            )
    else:
        if image_size is None:
            problems.append(f"image_size is required for image model {spec.name!r}")
        for key in ("seq_len", "decoder_seq_len"):
            if shapes.get(key) is not None:
                problems.append(f"{key} does not apply to image model {spec.name!r} (use image_size)")
        model_size = hf.get("image_size")
        if _is_pos_int(image_size) and _is_pos_int(model_size) and image_size != model_size:
            problems.append(
                f"image_size {image_size} differs from {spec.name!r}'s image_size {model_size} (its position "
                "embeddings fix the resolution; override hf_config image_size to plan another one)"
            )
    return problems


def _shape_of(value: Any) -> tuple[int, ...] | None:
    shape = getattr(value, "shape", None)
    return tuple(int(d) for d in shape) if shape is not None else None


def _sequence_lengths(value: Sequence[Any], key: str, problems: list[str]) -> list[int]:
    """Lengths of a list of 1-D sequences (tensors or lists of ints)."""
    lengths: list[int] = []
    for i, seq in enumerate(value):
        shape = _shape_of(seq)
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


def _collate_rows(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """A list of per-example dicts (as a dataset yields them) -> a dict of per-key lists."""
    keys: list[str] = []
    for row in rows:
        keys.extend(k for k in row if k not in keys)
    return {k: [row[k] for row in rows if k in row] for k in keys}


def _shapes_from_batch(batch: Mapping[str, Any], spec: ModelSpec | None) -> tuple[dict[str, Any], list[str]]:
    """Read sample shapes from a real (or fake-tensor) batch; returns (shapes, problems)."""
    problems: list[str] = []
    unknown = sorted(set(batch) - set(BATCH_KEYS))
    if unknown:
        problems.append(f"unknown batch keys {unknown} (valid keys: {list(BATCH_KEYS)})")
    dims: dict[str, tuple[int, ...]] = {}  # key -> (batch, length, ...) as planned
    variable = False
    for key, value in batch.items():
        if key in unknown:
            continue
        shape = _shape_of(value)
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

    is_image = "pixel_values" in dims or (spec is not None and not spec.is_token_model)
    if is_image:
        pixels = dims.get("pixel_values")
        if pixels is None:
            problems.append("an image batch needs pixel_values of shape (batch, channels, height, width)")
        elif len(pixels) != 4:
            problems.append(f"pixel_values must be (batch, channels, height, width), got shape {list(pixels)}")
        elif pixels[2] != pixels[3]:
            problems.append(f"pixel_values must be square images, got {pixels[2]}x{pixels[3]}")
        else:
            shapes["image_size"] = pixels[2]
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
    decoder_keys = [k for k in (*_DECODER_KEYS, "labels", "shift_labels") if k in dims and len(dims[k]) >= 2]
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


@dataclass(frozen=True, kw_only=True)
class SampleSpec:
    """The shape of one training step's batch.

    Token models have ``seq_len`` (and seq2seq models ``decoder_seq_len``, the label length; ``None`` means
    ``seq_len``); image models have ``image_size`` (square images). ``variable_length`` records that the real
    batches vary in length; plans are made for the longest (``seq_len`` is that maximum).
    """

    batch_size: int
    seq_len: int | None = None
    image_size: int | None = None
    decoder_seq_len: int | None = None
    variable_length: bool = False

    def __post_init__(self) -> None:
        problems = _shape_problems(self.to_dict(), None)
        if problems:
            raise ValueError("invalid sample: " + "; ".join(problems))

    @property
    def tokens_per_sample(self) -> int | None:
        """Input tokens per sample (``seq_len``) for token models; ``None`` for images."""
        return self.seq_len

    @property
    def decoder_len(self) -> int | None:
        """The seq2seq label/decoder length: ``decoder_seq_len``, else ``seq_len``; ``None`` for images."""
        return self.decoder_seq_len if self.decoder_seq_len is not None else self.seq_len

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (a valid input of :meth:`parse`)."""
        return dataclasses.asdict(self)

    @classmethod
    def parse(cls, sample: Any = None, spec: ModelSpec | str | dict[str, Any] | None = None) -> SampleSpec:
        """A sample spec from shapes or from a real batch, checked against ``spec`` when given.

        ``sample`` may be:

        * ``None``: the spec's ``sample`` (its typical training sample);
        * a dict of shapes, e.g. ``{"batch_size": 8, "seq_len": 4096}`` (keys: ``batch_size``, ``seq_len``,
          ``image_size``, ``decoder_seq_len``, ``variable_length``); missing keys come from the spec's ``sample``;
        * a batch: a dict of tensors (``input_ids``, ``labels``, ``attention_mask``, ``pixel_values``,
          ``decoder_input_ids``, ... real or fake tensors; only shapes are read), where a value may also be a list
          of 1-D sequences of different lengths (``variable_length=True``; the longest is planned for);
        * a list of sequences (token ids), or a list of per-example dicts as a dataset yields them;
        * a bare tensor: ``input_ids`` (2-D) or ``pixel_values`` (4-D);
        * a ``SampleSpec`` (re-checked against ``spec``).

        Raises ``ValueError`` naming every problem at once.
        """
        model = load_model_spec(spec) if spec is not None else None
        problems: list[str] = []
        if isinstance(sample, SampleSpec):
            shapes = sample.to_dict()
        elif sample is None:
            if model is None:
                raise ValueError(
                    "no sample given: pass a dict of shapes, a batch, or a model spec to take its typical sample from"
                )
            shapes = dict(model.sample)
        elif isinstance(sample, Mapping):
            batch_like = [k for k, v in sample.items() if _shape_of(v) is not None or _is_sequence(v)]
            if batch_like and len(batch_like) < len(sample):
                others = sorted(set(sample) - set(batch_like))
                raise ValueError(
                    f"sample mixes batch tensors {sorted(batch_like)} with other values {others}; pass either "
                    f"shapes (keys {list(SAMPLE_KEYS)}) or a batch (keys {list(BATCH_KEYS)})"
                )
            if batch_like:
                shapes, problems = _shapes_from_batch(sample, model)
            else:
                shapes = {**(model.sample if model is not None else {}), **sample}
        elif _shape_of(sample) is not None:
            ndim = len(_shape_of(sample) or ())
            key = "pixel_values" if ndim == 4 else "input_ids"
            shapes, problems = _shapes_from_batch({key: sample}, model)
        elif _is_sequence(sample):
            if sample and all(isinstance(row, Mapping) for row in sample):
                shapes, problems = _shapes_from_batch(_collate_rows(sample), model)
            else:
                shapes, problems = _shapes_from_batch({"input_ids": sample}, model)
        else:
            raise ValueError(
                f"cannot read a sample from {type(sample).__name__}; pass a dict of shapes "
                f"(keys {list(SAMPLE_KEYS)}), a batch dict (keys {list(BATCH_KEYS)}), or a list of sequences"
            )
        if model is not None and model.family == "seq2seq_lm" and shapes.get("decoder_seq_len") is None:
            shapes["decoder_seq_len"] = shapes.get("seq_len")
        problems = problems + [p for p in _shape_problems(shapes, model) if p not in problems]
        if problems:
            label = f" for model {model.name!r}" if model is not None else ""
            raise ValueError(f"invalid sample{label}: " + "; ".join(problems))
        known = {k: v for k, v in shapes.items() if k in SAMPLE_KEYS}
        return cls(**known)


def _is_sequence(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def _mlm_count(seq_len: int) -> int:
    """Masked positions per sequence in :func:`make_batch` (at least one, so the loss is never empty)."""
    return max(1, round(MLM_PROBABILITY * seq_len))


def config_vocab_size(cfg: Any) -> int | None:
    """A config's vocabulary; a composite one (a vision-language model's) keeps it in its text config."""
    vocab = getattr(cfg, "vocab_size", None)
    if vocab is None and callable(getattr(cfg, "get_text_config", None)):
        vocab = getattr(cfg.get_text_config(), "vocab_size", None)
    return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None


def make_batch(
    spec: ModelSpec | str | dict[str, Any],
    sample: SampleSpec | Mapping[str, Any] | None = None,
    *,
    device: str | torch.device = "cpu",
    generator: torch.Generator | None = None,
    config: Any = None,
) -> dict[str, torch.Tensor]:
    """A random batch of ``sample``'s shape that the spec's model accepts and that makes it return ``.loss``.

    * ``causal_lm``: ``input_ids`` and ``labels`` (a copy of ``input_ids``; the model shifts them);
    * ``masked_lm``: ``input_ids`` and ``labels`` with exactly ``round(0.15 * seq_len)`` (at least one) labelled
      positions per sequence, ``-100`` elsewhere (``token_type_ids`` default to zeros inside the model);
    * ``seq2seq_lm``: ``input_ids`` and ``labels`` of the decoder length (the model derives
      ``decoder_input_ids`` by shifting the labels right);
    * ``image_classification``: float32 ``pixel_values`` and ``labels`` (class ids).

    Token ids are uniform in ``[0, vocab_size)``. No ``attention_mask`` is included (see the module docstring).
    Works inside ``FakeTensorMode`` (only torch factory functions are used); ``generator``, if given, must be on
    ``device``. ``config`` is the model's config when it was built with overrides (default: ``hf_config(spec)``).
    A variable-length sample gives a full-length batch (its longest case).
    """
    from memopt.models.build import hf_config

    model = load_model_spec(spec)
    sample = SampleSpec.parse(sample, model)
    cfg = config if config is not None else hf_config(model)
    b = sample.batch_size
    if model.family == "image_classification":
        size = int(sample.image_size)  # type: ignore[arg-type]
        channels = int(getattr(cfg, "num_channels", 3))
        pixels = torch.randn(b, channels, size, size, generator=generator, device=device, dtype=torch.float32)
        labels = torch.randint(0, int(cfg.num_labels), (b,), generator=generator, device=device)
        return {"pixel_values": pixels, "labels": labels}

    vocab = config_vocab_size(cfg)
    if vocab is None:
        raise ValueError(f"cannot make token batches for {type(cfg).__name__}: it has no vocab_size (nor its text "
                         "config); pass a batch of your own as sample=")
    s = int(sample.seq_len)  # type: ignore[arg-type]
    input_ids = torch.randint(0, vocab, (b, s), generator=generator, device=device)
    if model.family == "causal_lm":
        return {"input_ids": input_ids, "labels": input_ids.clone()}
    if model.family == "sequence_classification":
        labels = torch.randint(0, int(cfg.num_labels), (b,), generator=generator, device=device)
        return {"input_ids": input_ids, "labels": labels}
    if model.family == "token_classification":
        labels = torch.randint(0, int(cfg.num_labels), (b, s), generator=generator, device=device)
        return {"input_ids": input_ids, "labels": labels}
    if model.family == "masked_lm":
        k = _mlm_count(s)
        order = torch.rand(b, s, generator=generator, device=device).argsort(dim=1)
        positions = order[:, :k]
        labels = torch.full((b, s), -100, dtype=input_ids.dtype, device=device)
        labels.scatter_(1, positions, input_ids.gather(1, positions))
        return {"input_ids": input_ids, "labels": labels}
    # seq2seq_lm
    t = int(sample.decoder_len)  # type: ignore[arg-type]
    labels = torch.randint(0, vocab, (b, t), generator=generator, device=device)
    return {"input_ids": input_ids, "labels": labels}


def token_count(batch: Mapping[str, torch.Tensor], spec: ModelSpec | str | dict[str, Any] | None = None) -> int:
    """How many items of ``batch`` contribute to the loss: the ``num_items_in_batch`` for exact gradient accumulation.

    Token batches: labels that are not ``-100``. Causal LMs predict token ``i+1`` from position ``i``, so with
    ``spec`` of family ``causal_lm`` the first label of each row is not counted (as transformers' loss and Trainer
    do); a ``shift_labels`` entry, when present, is counted as given. Image batches: the number of samples.
    Needs real tensors (the count depends on values).
    """
    family = load_model_spec(spec).family if spec is not None else None
    if "shift_labels" in batch:
        return int((batch["shift_labels"] != -100).sum())
    if family in ("image_classification", "sequence_classification") or ("pixel_values" in batch and family is None):
        source = batch.get("pixel_values", batch.get("labels", batch.get("input_ids")))
        if source is None:
            raise ValueError("an image batch needs pixel_values or labels to count samples")
        return int(source.shape[0])
    labels = batch.get("labels")
    if labels is None:
        raise ValueError(f"batch has no labels (keys: {sorted(batch)}); token_count counts labels != -100")
    if family == "causal_lm":
        labels = labels[..., 1:]
    return int((labels != -100).sum())


def expected_token_count(spec: ModelSpec | str | dict[str, Any], sample: SampleSpec | Mapping[str, Any] | None) -> int:
    """What ``token_count(make_batch(spec, sample), spec)`` returns, from shapes alone (usable under fake tensors)."""
    model = load_model_spec(spec)
    sample = SampleSpec.parse(sample, model)
    b = sample.batch_size
    if model.family in ("image_classification", "sequence_classification"):
        return b
    s = int(sample.seq_len)  # type: ignore[arg-type]
    if model.family == "causal_lm":
        return b * (s - 1)
    if model.family == "token_classification":
        return b * s
    if model.family == "masked_lm":
        return b * _mlm_count(s)
    return b * int(sample.decoder_len)  # type: ignore[arg-type]
