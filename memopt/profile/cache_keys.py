"""Where profiles are cached and under which key: the cache folder (``$MEMOPT_CACHE_DIR``), the profile schema
version and the trace revision (bumped whenever what a trace records changes, so older cached traces are made again),
and the two hashes a cached profile is found by -- of a model spec, without building the model (:func:`spec_key`), or
of a built model's structure (:func:`structure_key`). Kept apart from :class:`memopt.profile.profile.Profile` because
the calibration and estimate stores key their own files the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memopt.profile.module_code import module_code_key

__all__ = ["SCHEMA_VERSION", "TRACE_REVISION", "cache_dir", "spec_key", "structure_key"]

SCHEMA_VERSION = 2  # 2: kernel counts without the metadata queries (memopt.kernel_ops.FREE_OPS)
# bumped whenever what a trace records changes (cached profiles of an older revision are traced again)
# 3: model specs are keyed on the spec (no model build); profiles record the vocabulary size
# 4: variants carry the strategy's extras (quantization, adapters) and record the transformed model's state;
#    optimizer traces are keyed on those extras too; CUDA softmax kernels' temporaries (softmax backward's
#    grad*output, _safe_softmax's mask) are recorded
# 5: phase costs count the calls of bitsandbytes' 4-bit linear (``bnb4_calls``, the time model's host floor)
# 6: every allocation records the module and op that made it (memopt.profile.attribution)
# 7: the memory-efficient kernel takes a mask that needs a gradient; no fused kernel takes a mask whose last dim
#    is strided
# 8: the batch's integer and boolean tensors carry their real values (memopt.profile.scalar_values)
# 9: selections by batch values are sized from their shadows; router choices on unknown values are balanced
#    and readable (memopt.profile.data_dependent, memopt.profile.scalar_values)
# 10: recurrent layers are one fused kernel (cuDNN's reserve space, its time steps as serial GPU kernels),
#     not one op per time step (memopt.profile.recurrent_kernels)
# 11: cuDNN's reserve space as measured (per layer 5/6/1 hidden vectors for LSTM/GRU/RNN, the outputs between
#     layers, 256 bytes of padding), not the earlier assumption
# 12: activation offload releases a saved tensor at the next save (one copy in flight), not when 256 MiB of copies
#     are outstanding (memopt.techniques.activation_offload)
# 13: the profile refuses micro-batching for a training forward that writes persistent buffers
#     (memopt.profile.sample_axis_probe)
# 14: a run of blocks inside a container that mixes other layers with them is a stack (memopt.blocks)
# 15: unique, unique_consecutive, bincount and repeat_interleave are sized from their shadows or bounded
#     (memopt.profile.data_dependent); a real dict sample's token ids are the traced batch's; a step that runs on
#     the whole batch only (a sequence-first batch as long as it is large) is traced whole
# 16: checks for NaN and infinity over activations read as finite; a floating value read in the step (loss.item())
#     reads as a stand-in instead of failing the trace (memopt.profile.scalar_values, memopt.profile.tracker)
# 17: a training forward that moves a module's number attribute at every call (a counter) refuses micro-batching
#     like one that writes a buffer; a list of per-sample dicts is traced as one record per sample; under adapters
#     a classifier's task head trains (memopt.techniques.adapter_merge.task_heads)
# 18: a grouped GEMM's weight gradient counts 2 x m x n x (all groups' rows) FLOPs, not that times the groups over
#     the rows (memopt.profile.costs); each module traces in the mode the user left it in
# 19: a random op that draws one number for one sample is probed at two (a per-sample drop path refuses
#     micro-batching under exact fidelity: memopt.profile.sample_axis_probe); the trace refuses the operand dtypes
#     CUDA's kernels refuse (memopt.profile.operand_checks); CTC losses are traced (memopt.profile.data_dependent);
#     every module beside a classifier's backbone is a task head under adapters
TRACE_REVISION = 19


def cache_dir() -> Path:
    """Where profiles and calibrations are cached: $MEMOPT_CACHE_DIR, else ~/.cache/memopt."""
    return Path(os.environ.get("MEMOPT_CACHE_DIR", Path.home() / ".cache" / "memopt"))


def spec_key(spec: Any, extra: dict[str, Any]) -> str:
    """A hash of what decides the traces of a model built from a spec: the spec (architecture and config), the
    sample, the kernel policy, the torch and transformers versions and memopt's profile schema. Unlike
    :func:`structure_key` it needs no model, so a cached profile is found without building one."""
    payload = {"spec": {"name": spec.name, "family": spec.family, "architecture": spec.architecture,
                        "hf_config": spec.hf_config},
               "extra": extra, "torch": torch.__version__, "transformers": _package_version("transformers"),
               "schema": SCHEMA_VERSION, "revision": TRACE_REVISION}
    return "s" + hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:23]


def _package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "none"


def structure_key(model: nn.Module, extra: dict[str, Any]) -> str:
    """A hash of what decides the traces: module classes and their code, modules' plain settings and hooks,
    parameter and buffer shapes and dtypes, the sample, the kernel policy, torch's version and memopt's profile
    schema."""
    h = hashlib.sha256()
    h.update(type(model).__qualname__.encode())
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        h.update(config.to_json_string(use_diff=False).encode())
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad};".encode())
    for name, b in model.named_buffers():  # a table sized by a constructor argument the module does not keep
        h.update(f"{name}:{tuple(b.shape)}:{b.dtype};".encode())
    # names, classes' code, modules' plain settings, a forward replaced on an instance, hooks
    h.update(module_code_key(model).encode())
    # the modes the trace runs in (memopt.profile.fake_model.train_as_given): a BatchNorm kept in eval traces apart
    h.update(("".join("t" if m.training else "e" for m in model.modules()) if model.training else "eval").encode())
    h.update(json.dumps(extra, sort_keys=True, default=str).encode())
    h.update(f"{torch.__version__}:{SCHEMA_VERSION}:{TRACE_REVISION}".encode())
    return h.hexdigest()[:24]
