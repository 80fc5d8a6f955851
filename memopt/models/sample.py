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

from memopt.models.sample_shapes import (
    BATCH_KEYS,
    collate_rows,
    is_sequence,
    shape_of,
    shape_problems,
    shapes_from_batch,
)
from memopt.models.spec import SAMPLE_KEYS, ModelSpec, load_model_spec

__all__ = ["BATCH_KEYS", "MLM_PROBABILITY", "SampleSpec", "config_vocab_size", "expected_token_count", "make_batch",
           "token_count"]

#: Fraction of positions that carry a masked-LM label (BERT's 15%).
MLM_PROBABILITY = 0.15


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
        problems = shape_problems(self.to_dict(), None)
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
