"""Training samples: their shapes (:class:`SampleSpec`), random batches that shape (:func:`make_batch`), and the
number of loss-contributing items in a batch (:func:`token_count`).

Batches deliberately carry no ``attention_mask``: for unpadded random data an all-ones mask means the same as no
mask, and without one transformers takes the ``is_causal`` / flash path instead of building a mask tensor. Under
``FakeTensorMode`` a fake mask could not even be inspected to prove it is all ones, so transformers would
materialise a full ``(batch, 1, seq, seq)`` mask that the real run never allocates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from memopt.models.build import config_class, hf_config
from memopt.models.sample_shapes import (
    BATCH_KEYS,
    collate_rows,
    image_sides,
    is_sequence,
    shape_of,
    shape_problems,
    shapes_from_batch,
)
from memopt.models.spec import SAMPLE_KEYS, ModelSpec, load_model_spec

__all__ = ["BATCH_KEYS", "MLM_PROBABILITY", "SampleSpec", "config_vocab_size", "expected_token_count",
           "is_decoder_only", "make_batch", "token_count"]

#: Fraction of positions that carry a masked-LM label (BERT's 15%).
MLM_PROBABILITY = 0.15


@dataclass(frozen=True, kw_only=True)
class SampleSpec:
    """The shape of one training step's batch.

    Token models have ``seq_len`` (and seq2seq models ``decoder_seq_len``, the label length; ``None`` means
    ``seq_len``); image models have ``image_size`` (a side for square images, else ``(height, width)``).
    ``variable_length`` records that the real
    batches vary in length; plans are made for the longest (``seq_len`` is that maximum). ``label_kind``: what a
    classifier's labels hold where they are not class ids, read from a real batch (``LABEL_KINDS``: float 0/1 per
    class, or float regression targets), so the batches made for it hold the same; None: class ids, or what the
    model's config says (its ``problem_type``).
    """

    batch_size: int
    seq_len: int | None = None
    image_size: int | tuple[int, int] | None = None
    decoder_seq_len: int | None = None
    variable_length: bool = False
    label_kind: str | None = None

    def __post_init__(self) -> None:
        problems = shape_problems(self.to_dict(), None)
        if problems:
            raise ValueError("invalid sample: " + "; ".join(problems))
        sides = image_sides(self.image_size)
        if sides is not None:  # a square is its side (as every sample was before pairs); a pair a tuple, once read
            object.__setattr__(self, "image_size", sides[0] if sides[0] == sides[1] else sides)

    @property
    def tokens_per_sample(self) -> int | None:
        """Input tokens per sample (``seq_len``) for token models; ``None`` for images."""
        return self.seq_len

    @property
    def decoder_len(self) -> int | None:
        """The seq2seq label/decoder length: ``decoder_seq_len``, else ``seq_len``; ``None`` for images."""
        return self.decoder_seq_len if self.decoder_seq_len is not None else self.seq_len

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (a valid input of :meth:`parse`); ``label_kind`` only where labels are not
        class ids, so the samples of every other batch (and the profile keys made of them) are as they were."""
        fields = dataclasses.asdict(self)
        if fields["label_kind"] is None:
            del fields["label_kind"]
        return fields

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
            batch_like = [k for k, v in sample.items() if shape_of(v) is not None or is_sequence(v)]
            if batch_like and len(batch_like) < len(sample):
                others = sorted(set(sample) - set(batch_like))
                raise ValueError(
                    f"sample mixes batch tensors {sorted(batch_like)} with other values {others}; pass either "
                    f"shapes (keys {list(SAMPLE_KEYS)}) or a batch (keys {list(BATCH_KEYS)})"
                )
            if batch_like:
                shapes, problems = shapes_from_batch(sample, model)
            else:
                shapes = {**(model.sample if model is not None else {}), **sample}
        elif shape_of(sample) is not None:
            ndim = len(shape_of(sample) or ())
            key = "pixel_values" if ndim == 4 else "input_ids"
            shapes, problems = shapes_from_batch({key: sample}, model)
        elif is_sequence(sample):
            if sample and all(isinstance(row, Mapping) for row in sample):
                shapes, problems = shapes_from_batch(collate_rows(sample), model)
            else:
                shapes, problems = shapes_from_batch({"input_ids": sample}, model)
        else:
            raise ValueError(
                f"cannot read a sample from {type(sample).__name__}; pass a dict of shapes "
                f"(keys {list(SAMPLE_KEYS)}), a batch dict (keys {list(BATCH_KEYS)}), or a list of sequences"
            )
        if model is not None and model.family == "seq2seq_lm" and shapes.get("decoder_seq_len") is None:
            shapes["decoder_seq_len"] = shapes.get("seq_len")
        problems = problems + [p for p in shape_problems(shapes, model) if p not in problems]
        if problems:
            label = f" for model {model.name!r}" if model is not None else ""
            raise ValueError(f"invalid sample{label}: " + "; ".join(problems))
        known = {k: v for k, v in shapes.items() if k in SAMPLE_KEYS}
        return cls(**known)


def _mlm_count(seq_len: int) -> int:
    """Masked positions per sequence in :func:`make_batch` (at least one, so the loss is never empty)."""
    return max(1, round(MLM_PROBABILITY * seq_len))


def config_vocab_size(cfg: Any) -> int | None:
    """A config's vocabulary; a composite one (a vision-language model's) keeps it in its text config."""
    vocab = getattr(cfg, "vocab_size", None)
    if vocab is None and callable(getattr(cfg, "get_text_config", None)):
        vocab = getattr(cfg.get_text_config(), "vocab_size", None)
    return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None


def is_decoder_only(spec: ModelSpec | str | dict[str, Any], config: Any = None) -> bool:
    """A ``seq2seq_lm`` model that is no encoder-decoder (``is_encoder_decoder`` false: the speech LLMs of that
    mapping, an audio encoder in front of a decoder-only LM): its loss is a causal LM's, over labels shaped like
    ``input_ids``. ``config`` is the model's config when at hand (else the spec's, from its config class)."""
    model = load_model_spec(spec)
    if model.family != "seq2seq_lm":
        return False
    if config is not None:
        return getattr(config, "is_encoder_decoder", True) is False
    default = getattr(config_class(model.model_type), "is_encoder_decoder", True)
    return model.hf_config.get("is_encoder_decoder", default) is False


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
      ``decoder_input_ids`` by shifting the labels right); a decoder-only model of that mapping (a speech LLM:
      ``is_encoder_decoder`` false, its audio tower fed by ``input_features``) computes a causal-LM loss over its
      text, so it gets causal-LM labels (a copy of ``input_ids``) and no audio: the text-only case;
    * ``image_classification``: float32 ``pixel_values`` and ``labels`` (class ids); a model that reads images as
      token ids (ImageGPT: a vocabulary, no channels) gets ``input_ids``, ``image_size ** 2`` a row, instead; one
      that reads them as sequences of flattened patches (SigLIP 2's NaFlex) gets those, with ``spatial_shapes``
      (the patch grid of each image: every patch is real, so no ``pixel_attention_mask``).

    Token ids are uniform in ``[0, vocab_size)`` (``[0, num_hash_buckets)`` for a model that hashes its ids and has
    no vocabulary: CANINE). Models that refuse to run on ids alone get what their config says they need: ``bbox``
    (BROS's ``dim_bbox``), ``lang_ids`` (X-MOD without a ``default_language``). No ``attention_mask`` is included
    (see the module docstring).
    Works inside ``FakeTensorMode`` (only torch factory functions are used); ``generator``, if given, must be on
    ``device``. ``config`` is the model's config when it was built with overrides (default: ``hf_config(spec)``).
    A variable-length sample gives a full-length batch (its longest case).
    """
    model = load_model_spec(spec)
    sample = SampleSpec.parse(sample, model)
    cfg = config if config is not None else hf_config(model)
    b = sample.batch_size
    if model.family == "image_classification":
        height, width = image_sides(sample.image_size)  # type: ignore[misc]
        if _pixels_as_tokens(cfg):
            ids = torch.randint(0, int(cfg.vocab_size), (b, height * width), generator=generator, device=device)
            return {"input_ids": ids, "labels": _class_labels(cfg, sample, generator, device)}
        patches = _patch_sequence(cfg, height, width)
        if patches is not None:
            rows, cols, patch_width = patches
            pixels = torch.randn(b, rows * cols, patch_width, generator=generator, device=device, dtype=torch.float32)
            shapes = torch.stack([torch.full((b,), side, dtype=torch.long, device=device) for side in (rows, cols)],
                                 dim=1)
            return {"pixel_values": pixels, "spatial_shapes": shapes,
                    "labels": _class_labels(cfg, sample, generator, device)}
        channels = int(getattr(cfg, "num_channels", 3))
        pixels = torch.randn(b, channels, height, width, generator=generator, device=device, dtype=torch.float32)
        return {"pixel_values": pixels, "labels": _class_labels(cfg, sample, generator, device)}

    vocab = config_vocab_size(cfg) or _hashed_id_range(cfg)
    if vocab is None:
        raise ValueError(f"cannot make token batches for {type(cfg).__name__}: it has no vocab_size (nor its text "
                         "config); pass a batch of your own as sample=")
    s = int(sample.seq_len)  # type: ignore[arg-type]
    batch = _token_batch(model, cfg, sample, vocab, generator, device)
    return {**batch, **_extra_inputs(cfg, b, s, generator, device)}


def _class_labels(cfg: Any, sample: SampleSpec, generator: torch.Generator | None,
                  device: str | torch.device) -> torch.Tensor:
    """A classifier's labels as the sample's (``label_kind``), else as its config's ``problem_type`` asks (a model
    of one label regresses, as transformers' heads do): class ids ``(batch,)``; ``multi_label``, a float 0/1 per
    class ``(batch, num_labels)``; ``regression``, float targets ``(batch,)`` for one label, else one per label."""
    b, n = sample.batch_size, int(cfg.num_labels)
    problem = getattr(cfg, "problem_type", None)
    kind = sample.label_kind or {"multi_label_classification": "multi_label", "regression": "regression"}.get(
        problem, "regression" if problem is None and n == 1 else None)
    if kind == "multi_label":
        return torch.randint(0, 2, (b, n), generator=generator, device=device).float()
    if kind == "regression":
        return torch.randn((b,) if n == 1 else (b, n), generator=generator, device=device)
    return torch.randint(0, n, (b,), generator=generator, device=device)


def _pixels_as_tokens(cfg: Any) -> bool:
    """An image classifier that reads an image as token ids, one a pixel (ImageGPT's colour clusters): its config
    has a vocabulary and neither channels nor an image size."""
    vocab = getattr(cfg, "vocab_size", None)
    return isinstance(vocab, int) and not hasattr(cfg, "num_channels") and not hasattr(cfg, "image_size")


def _patch_sequence(cfg: Any, height: int, width: int) -> tuple[int, int, int] | None:
    """An image classifier that reads an image as a sequence of flattened patches with its patch grid (SigLIP 2's
    NaFlex: ``pixel_values`` of ``(batch, patches, channels * patch_size ** 2)`` and ``spatial_shapes``): its
    (vision) config has ``num_patches`` and a ``patch_size`` but no ``image_size``. Returns the patch grid's rows
    and columns for a ``height`` x ``width`` image and a patch's width, or None."""
    vision = getattr(cfg, "vision_config", None) or cfg
    patches, patch = getattr(vision, "num_patches", None), getattr(vision, "patch_size", None)
    if not isinstance(patches, int) or not isinstance(patch, int) or hasattr(vision, "image_size"):
        return None
    return height // patch, width // patch, int(getattr(vision, "num_channels", 3)) * patch * patch


def _hashed_id_range(cfg: Any) -> int | None:
    """A model without a vocabulary that hashes its ids into ``num_hash_buckets`` (CANINE's Unicode code points)
    takes any id: they are drawn from ``[0, num_hash_buckets)``."""
    buckets = getattr(cfg, "num_hash_buckets", None)
    return buckets if isinstance(buckets, int) and not isinstance(buckets, bool) and buckets > 0 else None


def _extra_inputs(cfg: Any, b: int, s: int, generator: torch.Generator | None,
                  device: str | torch.device) -> dict[str, torch.Tensor]:
    """Inputs besides the ids that a model refuses to run without, by its config: a layout model's word boxes
    (``dim_bbox`` coordinates in ``[0, 1)`` per token: BROS), and the language of an X-MOD batch when the config
    names no ``default_language`` (the first of its ``languages``)."""
    extra: dict[str, torch.Tensor] = {}
    dim_bbox = getattr(cfg, "dim_bbox", None)
    if isinstance(dim_bbox, int) and dim_bbox > 0:
        extra["bbox"] = torch.rand(b, s, dim_bbox, generator=generator, device=device)
    if getattr(cfg, "languages", None) and getattr(cfg, "default_language", "") is None:
        extra["lang_ids"] = torch.zeros(b, dtype=torch.long, device=device)
    return extra


def _token_batch(model: ModelSpec, cfg: Any, sample: SampleSpec, vocab: int, generator: torch.Generator | None,
                 device: str | torch.device) -> dict[str, torch.Tensor]:
    b, s = sample.batch_size, int(sample.seq_len)  # type: ignore[arg-type]
    input_ids = torch.randint(0, vocab, (b, s), generator=generator, device=device)
    if model.family == "causal_lm":
        return {"input_ids": input_ids, "labels": input_ids.clone()}
    if model.family == "sequence_classification":
        return {"input_ids": input_ids, "labels": _class_labels(cfg, sample, generator, device)}
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
    if is_decoder_only(model, cfg):
        return {"input_ids": input_ids, "labels": input_ids.clone()}
    t = int(sample.decoder_len)  # type: ignore[arg-type]
    labels = torch.randint(0, vocab, (b, t), generator=generator, device=device)
    return {"input_ids": input_ids, "labels": labels}


def token_count(batch: Mapping[str, torch.Tensor], spec: ModelSpec | str | dict[str, Any] | None = None) -> int:
    """How many items of ``batch`` contribute to the loss: the ``num_items_in_batch`` for exact gradient accumulation.

    Token batches: labels that are not ``-100``. Causal LMs predict token ``i+1`` from position ``i``, so with
    ``spec`` of family ``causal_lm`` (or a decoder-only ``seq2seq_lm``: :func:`is_decoder_only`) the first label
    of each row is not counted (as transformers' loss and Trainer do); a ``shift_labels`` entry, when present, is
    counted as given. Image batches: the number of samples.
    Needs real tensors (the count depends on values).
    """
    family = load_model_spec(spec).family if spec is not None else None
    if family == "seq2seq_lm" and is_decoder_only(spec):  # type: ignore[arg-type]
        family = "causal_lm"
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
    if model.family == "causal_lm" or is_decoder_only(model):
        return b * (s - 1)
    if model.family == "token_classification":
        return b * s
    if model.family == "masked_lm":
        return b * _mlm_count(s)
    return b * int(sample.decoder_len)  # type: ignore[arg-type]
