"""The batches the profile traces the step with, at any number of samples: made from a model spec's sample shapes
(``make_batch``), from a real batch of a model memopt can make batches for (its shapes, with the real rows' token
ids and masks), or with the structure of any real batch (``memopt.step.batch_like``), and the whole batch only
where the step runs on nothing less."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from memopt.models import ModelSpec, SampleSpec, make_batch
from memopt.models.hf_task import hf_task
from memopt.models.sample import BATCH_KEYS
from memopt.profile.real_rows import MASKS, real_rows, with_real_rows
from memopt.profile.trace import BatchFactory
from memopt.step import batch_like, batch_samples, batch_tree

__all__ = ["batch_factory_for", "is_shapes", "spec_batch_factory", "spec_from_module", "structure_factory",
           "whole_batch_factory"]


def spec_from_module(module: nn.Module) -> Any:
    """A model spec for a Hugging Face model instance (so shape samples work for it), or None."""
    config = getattr(module, "config", None)
    name = type(module).__name__
    family = hf_task(module)
    if config is None or family is None or not hasattr(config, "to_dict"):
        return None
    hf = {k: v for k, v in config.to_diff_dict().items() if not k.startswith("_")}
    hf["model_type"] = config.model_type
    sample: dict[str, Any] = {}
    if family == "image_classification":
        sample["image_size"] = getattr(config, "image_size", 224)
    return ModelSpec(name=name, family=family, architecture=name, hf_config=hf,
                     **{_SAMPLE_FIELD: sample})


_SAMPLE_FIELD = "defaults" if "defaults" in ModelSpec.__dataclass_fields__ else "sample"


def is_shapes(sample: Any) -> bool:
    """Sample shapes (``{"batch_size": 8, "seq_len": 512}``): no tensor anywhere in the dict. A tensor at any depth
    makes it a batch (``{"inputs": {"x": x}, "targets": {"y": y}}`` holds none at its top level)."""
    return sample is None or (isinstance(sample, dict) and not batch_tree.tensors(sample))


def _is_model_batch(sample: Any) -> bool:
    """A dict batch of the model's own inputs (made again by ``make_batch`` at any size); a batch with other keys
    (a target beside the inputs) is traced with its own structure."""
    return isinstance(sample, dict) and ("input_ids" in sample or "pixel_values" in sample) and set(sample) <= set(
        BATCH_KEYS)


def batch_factory_for(spec: Any, sample: Any, module: nn.Module) -> tuple[BatchFactory, dict[str, Any], int | None]:
    """A function (micro_batch, device) -> batch, the sample as a dict, and tokens per sample."""
    if isinstance(sample, Mapping) and not isinstance(sample, dict):
        sample = dict(sample)  # a tokenizer's or collator's BatchEncoding (a UserDict) is the dict batch it holds
    if spec is None and (is_shapes(sample) or isinstance(sample, dict)):
        derived = spec_from_module(module)
        if derived is not None and (is_shapes(sample) or _is_model_batch(sample)):
            spec = derived
    if spec is not None:
        parsed = SampleSpec.parse(sample, spec)
        config = getattr(module, "config", None)
        rows = real_rows(sample)

        def factory(b: int, device: str) -> dict[str, Any]:
            batch = make_batch(spec, SampleSpec(**{**parsed.to_dict(), "batch_size": b}), device=device,
                               config=config)
            return with_real_rows(batch, rows, b)

        factory.values_are_real = True  # type: ignore[attr-defined]  # ids, masks and labels as a real batch's
        _key_padded_rows(factory, rows)
        tokens = parsed.seq_len if spec.is_token_model else None
        return factory, parsed.to_dict(), tokens
    if isinstance(sample, dict) and sample and is_shapes(sample):
        raise ValueError(
            f"sample shapes {sorted(sample)} need a model memopt can make batches for (a transformers causal LM, "
            f"seq2seq LM, masked LM, sequence/token or image classifier); {type(module).__name__} is not one: pass "
            "a real batch instead, e.g. {'x': torch.randn(32, 784), 'labels': torch.zeros(32, dtype=torch.long)}"
        )
    return structure_factory(sample)


def _key_padded_rows(factory: Any, rows: dict[str, torch.Tensor]) -> None:
    """A padded row takes other attention paths than a full one: which rows are padded keys the profile (not the
    mask itself: another batch padded in the same rows finds the same traces)."""
    padding = {k: m for k, m in rows.items() if k in MASKS}
    if padding:
        factory.key_part = {k: "".join("p" if bool((m[i] == 0).any()) else "f" for i in range(m.shape[0]))
                            for k, m in padding.items()}


def structure_factory(sample: Any) -> tuple[BatchFactory, dict[str, Any], int | None]:
    """Fake batches with the structure of a real one (any nesting of tensors, tuples, lists and dicts:
    ``memopt.step.batch``), ``b`` samples each."""
    if not batch_tree.is_batch(sample) or not batch_tree.tensors(sample):
        raise ValueError(
            "a custom nn.Module needs sample=<a batch>: a tensor, or a tuple, list, dict or dataclass of tensors "
            "shaped like one global batch (samples along the first dimension), e.g. (torch.randn(32, 784), "
            "torch.zeros(32, dtype=torch.long)) or {'x': torch.randn(32, 784), 'labels': torch.zeros(32, "
            f"dtype=torch.long)}}; got {type(sample).__name__}"
            + ("; pass one batch of it: sample=next(iter(loader))" if hasattr(sample, "__iter__")
               and not isinstance(sample, (str, bytes, dict, list, tuple)) else "")
        )
    try:
        batch_size = batch_samples.batch_size(sample)
    except ValueError as exc:
        raise ValueError(f"invalid sample batch: {exc}") from None
    template = batch_tree.tree_map(lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), sample)
    fill = batch_like.integer_maxima(sample)
    whole = batch_samples.indivisible(sample)

    rows = real_rows(sample)

    def factory(b: int, device: str) -> Any:
        # an indivisible batch is one sample: every batch made is the whole one, whatever b
        made = batch_like.like(template, None if whole else b, device, fill)
        # the real token ids and masks, rows in turn: a model may read their values (a vision-language model
        # finds its image placeholder tokens among the ids)
        return with_real_rows(made, rows, b) if rows and not whole and isinstance(made, dict) else made

    _key_padded_rows(factory, rows)

    tensors = {path: [list(t.shape), str(t.dtype)] for path, t in batch_tree.leaves(sample)}  # for reports
    facts = {"batch_size": batch_size, "tensors": tensors, "structure": batch_tree.structure(sample)}
    if whole:
        facts["indivisible"] = whole
    if any(v is not None for v in fill):  # the values traced with: a profile made for other values is not this one
        facts["integer_maxima"] = fill
    return factory, facts, None


def spec_batch_factory(spec: Any, sample: Any, config: Callable[[], Any]
                        ) -> tuple[BatchFactory, dict[str, Any], int | None]:
    """As :func:`batch_factory_for` for a model spec, without building the model (``config`` is called when
    a batch is made)."""
    parsed = SampleSpec.parse(sample, spec)

    def factory(b: int, device: str) -> dict[str, Any]:
        return make_batch(spec, SampleSpec(**{**parsed.to_dict(), "batch_size": b}), device=device, config=config())

    factory.values_are_real = True  # type: ignore[attr-defined]  # ids, masks and labels as a real batch's
    return factory, parsed.to_dict(), parsed.seq_len if spec.is_token_model else None


def whole_batch_factory(factory: BatchFactory, samples: int) -> BatchFactory:
    """``factory`` making the whole batch of ``samples`` whatever it is asked for: the traces at 1 and 2 samples of
    a step that runs on the whole batch only are the whole batch's (a micro-batch of it adds nothing)."""
    def whole(b: int, device: str) -> Any:
        return factory(samples, device)

    whole.__dict__.update(getattr(factory, "__dict__", {}))  # values_are_real, key_part
    return whole
