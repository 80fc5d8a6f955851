"""Every (task, model_type) pair of transformers' six auto-model mappings, built tiny, and its cheap check.

The pairs are read from the installed transformers at collection time, so a new release adds its families by
itself. A pair that cannot be built tiny, or that memopt cannot plan or step exactly, is in ``unbuildable.json``
with the reason (made by ``python -m tests.zoo.make_unbuildable``); every other pair must pass :func:`check_pair`.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.zoo.hf_families import _AUTO, TASKS
from tests.zoo.tiny_config import tiny_config

#: "a few million parameters at most"
PARAM_LIMIT = 5_000_000
UNBUILDABLE = Path(__file__).with_name("unbuildable.json")
BATCH = 1  # one sample: the profile traces one pass instead of two (the zoo runs every pair)
#: why torchvision's classifiers are not in the zoo (``test_torchvision_is_still_unavailable`` re-checks it)
TORCHVISION_REASON = ("PyPI's torchvision wheels are built against torch's CUDA build: beside the pinned torch "
                      "2.13.0 CPU build, `import torchvision` fails ('operator torchvision::nms does not exist')")
EXACT = {"precision": "fp32", "optimizer": "sgd", "micro_batch_size": BATCH, "checkpointing": "none",
         "activation_offload": False, "chunked_ce": 0}


def mapping_pairs() -> list[str]:
    """``task:model_type`` for every entry of the six mappings, sorted."""
    from transformers.models.auto import modeling_auto

    from memopt.models.hf_task import HF_TASKS

    return sorted(f"{task}:{mt}" for task in TASKS for mt in getattr(modeling_auto, HF_TASKS[task]))


def representatives() -> set[str]:
    """One pair per family, the one memopt's full check runs on: its first task in the order of ``TASKS``
    (the other pairs of a family share its blocks and differ by the head: they are built, not stepped)."""
    first: dict[str, str] = {}
    for pair in mapping_pairs():
        task, model_type = pair.split(":")
        if model_type not in first or TASKS.index(task) < TASKS.index(first[model_type]):
            first[model_type] = task
    return {f"{task}:{mt}" for mt, task in first.items()}


def listed() -> dict[str, str]:
    """The committed reason list: ``task:model_type`` -> why it is not checked."""
    return json.loads(UNBUILDABLE.read_text())["pairs"]


@functools.cache
def _config(model_type: str) -> Any:
    return tiny_config(model_type)  # one config per family, shared by its tasks


def build(pair: str, seed: int = 0) -> nn.Module:
    import transformers

    task, model_type = pair.split(":")
    # a copy: some models write to the config they are given (T5ForTokenClassification sets is_encoder_decoder to
    # False), which would change every later build of the family from the shared one
    config = copy.deepcopy(_config(model_type))
    if task == "causal_lm" and getattr(config, "is_decoder", None) is False:
        # a causal LM is a decoder, as its checkpoints say (an encoder family's LM head attends causally only so;
        # Reformer's refuses to be built otherwise); the family's other tasks keep the encoder's config
        config.is_decoder = True
    torch.manual_seed(seed)
    model = getattr(transformers, _AUTO[task]).from_config(config)
    n = sum(p.numel() for p in model.parameters())
    if n > PARAM_LIMIT:
        raise ValueError(f"the tiny config still has {n / 1e6:.1f}M parameters (limit {PARAM_LIMIT / 1e6:.0f}M)")
    return model.train()


def sample(task: str) -> dict[str, int]:
    if task == "image_classification":
        return {"batch_size": BATCH, "image_size": 64}  # a 2x2 map after /32: BatchNorm sees >1 value
    if task == "seq2seq_lm":
        return {"batch_size": BATCH, "seq_len": 16, "decoder_seq_len": 8}
    return {"batch_size": BATCH, "seq_len": 16}


def check_pair(pair: str) -> None:
    """Built tiny on the CPU, planned by ``memopt.wrap`` (exact pins: fp32, no technique, SGD), one wrapped step
    whose loss and updated parameters equal one unwrapped step's. Raises what went wrong."""
    import memopt
    from memopt.models import SampleSpec, make_batch
    from memopt.profile.batch_factories import spec_from_module

    task = pair.split(":")[0]
    model = build(pair)
    spec = spec_from_module(model)
    batch = make_batch(spec, SampleSpec.parse(sample(task), spec), generator=torch.Generator().manual_seed(7),
                       config=model.config)
    wrapped = memopt.wrap(model, budget="20GB", sample=sample(task), hardware="h200", optimizer="sgd", lr=0.05,
                          pins=EXACT, guard=False, autotune=False)
    got = float(wrapped.step({k: v.clone() for k, v in batch.items()}))
    ref = build(pair)
    for module in ref.modules():  # a training loop keeps no KV cache (hybrid caches refuse a training forward)
        if getattr(getattr(module, "config", None), "use_cache", False):
            module.config.use_cache = False
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    loss = ref(**batch).loss
    loss.backward()
    opt.step()
    torch.testing.assert_close(got, float(loss), rtol=1e-5, atol=1e-6, msg=lambda m: f"loss: {m}")
    for (name, a), (_, b) in zip(wrapped.unwrap().named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def failure(pair: str, full: bool = True) -> str | None:
    """Why :func:`check_pair` (``full``) or :func:`build` fails for ``pair`` (one line: the exception), or None."""
    try:
        check_pair(pair) if full else build(pair)
    except Exception as e:  # the reason list records any failure, with its type
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"{type(e).__name__}: {first[:240]}"
    return None
