"""``memopt.profile``: what a model needs in memory and compute, recorded once on the CPU.

A ``Profile`` holds the model's static facts (parameters and buffers by module and dtype, its block
stacks), the traces of the variants the planner has asked for (one forward + backward of the
block-truncated model at micro-batch 1 and 2), and the optimizer traces. It serializes to JSON with a
schema version and is cached under a key of the model's structure, the sample, the kernel policy of
the planned hardware and the torch version. Variants missing from a loaded profile are traced on
demand when the model is at hand.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memopt import progress
from memopt.hardware import HardwareSpec
from memopt.profile.attention_select import UnsupportedAttention
from memopt.profile.cache_keys import SCHEMA_VERSION
from memopt.profile.cuda_semantics import KernelPolicy
from memopt.profile.model_state import expand_model_state
from memopt.profile.optimizer_scaling import model_layout, scaled_optimizer_trace, trainable_params
from memopt.profile.optimizer_trace import OptimizerTrace, trace_optimizer
from memopt.profile.step_failures import describe_step_failure
from memopt.profile.trace import BatchFactory, TraceAlignmentError, trace_variant
from memopt.profile.tracker import FLOAT_READ_STAND_IN
from memopt.profile.variant_trace import PRECISION_GROUP, VariantKey, VariantTrace
from memopt.techniques.micro_batching import MicroBatchTooSmall
from memopt.techniques.optimizers import variant as variant_of
from memopt.techniques.precision import stored_dtype, uses_grad_scaler, weight_dtype
from memopt.units import allocator_size

__all__ = ["STEP_FAILS", "Profile", "VariantFailed"]

STEP_FAILS = "the model's step fails as "  # + "<variant label> (<error>)": VariantFailed's message



class VariantFailed(ValueError):
    """The model's own training step raises under a variant (an fp32 input meeting bf16 weights, an op without a
    bf16 kernel): the candidates that need the variant cannot run; the planner refuses them with this reason."""


@dataclass
class Profile:
    """The recorded facts of one model, sample and target GPU stack."""

    key: str
    model_name: str
    model_class: str
    family: str | None
    num_params: int
    num_trainable_params: int
    param_sizes: list[tuple[int, str, bool]]  # per distinct parameter: (numel, dtype, requires_grad)
    buffer_sizes: list[tuple[int, str]]
    params_by_module: dict[str, dict[str, int]]
    stacks: list[dict[str, Any]]
    sample: dict[str, Any]
    tokens_per_sample: int | None
    hardware: str
    kernel_policy: str
    torch_version: str
    variants: dict[VariantKey, VariantTrace] = field(default_factory=dict)
    optimizers: dict[tuple[str, str, str], OptimizerTrace] = field(default_factory=dict)  # (precision, opt, extras)
    moe: dict[str, Any] | None = None
    analytic: bool = False
    notes: list[str] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION
    trace_s: float = 0.0
    vocab_size: int | None = None  # the model config's, when it has one (the planner's chunked-loss options)
    # memopt.profile.engine_facts.ModelFacts as a dict: what the sharding engines' memory depends on (None in
    # profiles cached before it was recorded: the model is built again to count them)
    engine_facts: dict[str, Any] | None = None
    # why chunked cross-entropy would not be exact for this causal LM (None: it is exact, or not a causal LM)
    chunked_ce_refusal: str | None = None
    liger_ce_refusal: str | None = None  # why Liger's fused loss would not be exact (memopt.techniques.liger_ce)
    # why micro-batches would not be exact for this model (memopt.techniques.micro_batching; None: they are)
    micro_batch_refusal: str | None = None
    # the aten ops the training forward draws random numbers with (memopt.profile.sample_axis_probe; empty: none;
    # None: not probed, as in profiles cached before it was recorded)
    forward_random_ops: list[str] | None = None
    # the model's cuDNN recurrent layers (nn.RNN, nn.GRU, nn.LSTM): a static fact, read from the module each time
    recurrent_layers: list[str] = field(default_factory=list)
    # why the step runs on the whole batch only (memopt.profile.sample_axis_probe: a batch whose dim 0 is not the
    # samples, which fails on part of it): every trace is of the whole batch, and no micro-batch is smaller
    whole_batch: str | None = None
    # not serialized: what lazy tracing needs
    _model: nn.Module | None = field(default=None, repr=False, compare=False)
    _model_builder: Callable[[], nn.Module] | None = field(default=None, repr=False, compare=False)
    _batch_factory: BatchFactory | None = field(default=None, repr=False, compare=False)
    _policy: KernelPolicy | None = field(default=None, repr=False, compare=False)
    _loss_fn: Any = field(default=None, repr=False, compare=False)
    _optimizer_spec: Any = field(default=None, repr=False, compare=False)
    _cache_path: Path | None = field(default=None, repr=False, compare=False)
    _failed: dict[VariantKey, str] = field(default_factory=dict, repr=False, compare=False)
    _saves_held: int = field(default=0, repr=False, compare=False)  # > 0: inside batched_saves
    _save_pending: bool = field(default=False, repr=False, compare=False)
    # facts computed from the traces by other modules, kept for the profile's life (not saved): name -> value
    derived: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    # -- derived facts -------------------------------------------------------------------------
    @property
    def full_block_counts(self) -> list[int]:
        return [s["num_blocks"] for s in self.stacks]

    @property
    def trainable_dtypes(self) -> set[str]:
        """The dtypes (torch names) of the trainable parameters: what an optimizer must be able to step."""
        return {dtype for _, dtype, grad in self.param_sizes if grad}

    def param_bytes(self, weight_dtype: torch.dtype = torch.float32) -> int:
        """Parameter bytes on the GPU under a precision of ``weight_dtype`` (``stored_dtype``; allocator-rounded)."""
        return sum(allocator_size(numel * stored_dtype(weight_dtype, getattr(torch, dtype)).itemsize)
                   for numel, dtype, _ in self.param_sizes)

    def buffer_bytes(self, weight_dtype: torch.dtype = torch.float32) -> int:
        return sum(allocator_size(numel * stored_dtype(weight_dtype, getattr(torch, dtype)).itemsize)
                   for numel, dtype in self.buffer_sizes)

    # -- traces ----------------------------------------------------------------------------------
    def can_trace(self) -> bool:
        has_model = self._model is not None or self._model_builder is not None
        return has_model and self._batch_factory is not None and self._policy is not None

    def model(self) -> nn.Module | None:
        """The attached model, built now if it was attached as a builder (None when none is attached)."""
        if self._model is None and self._model_builder is not None:
            self._model = self._model_builder()
            self._model_builder = None
        return self._model

    def variant(self, key: VariantKey, micro_batch: int = 1) -> VariantTrace:
        """The trace of ``key`` that covers ``micro_batch`` (traced now if missing and the model is at hand)."""
        batch = int(self.sample.get("batch_size", 1))
        if self.whole_batch and micro_batch < batch:
            # every trace is of the whole batch (the step fails on less), so a smaller micro-batch has no trace
            raise VariantFailed(f"{STEP_FAILS}{key.at(micro_batch).label()} ({self.whole_batch}: micro-batches of "
                                f"{micro_batch} cannot run; leave micro_batch_size unpinned or pin it to {batch})")
        if key.activation_offload or (micro_batch == 1 and self._one_sample()):
            # offload's bounded copy window makes the event sequence depend on the bytes: trace each size. With a
            # batch of one sample no plan has a larger micro-batch: one pass instead of the two of a linear trace
            exact = key.at(micro_batch)
            found = self.variants.get(exact)
            if found is None and not key.activation_offload:
                linear = self.variants.get(key.at(None))
                found = linear if linear is not None and linear.covers(micro_batch) else None
            return found or self._trace(exact)
        linear = key.at(None)
        trace = self.variants.get(linear)
        if trace is None:
            trace = self._trace(linear)
        if trace.covers(micro_batch):
            return trace
        exact = key.at(micro_batch)
        return self.variants.get(exact) or self._trace(exact)

    def _one_sample(self) -> bool:
        return int(self.sample.get("batch_size", 0)) == 1

    def _trace(self, key: VariantKey) -> VariantTrace:
        if not self.can_trace():
            raise ValueError(
                f"the profile has no trace of {key.label()} and was loaded without its model; "
                "profile the model again (memopt.profile(model, ...)) to trace it"
            )
        if key in self._failed:
            raise VariantFailed(self._failed[key])
        start = time.perf_counter()
        try:
            traces = trace_variant(self.model(), self._batch_factory, key, self._policy, loss_fn=self._loss_fn)
        except UnsupportedAttention as exc:
            self._failed[key] = f"{key.label()}: {exc}"
            raise ValueError(self._failed[key]) from exc
        except TraceAlignmentError as exc:
            raise ValueError(f"memopt cannot extrapolate this model's memory over micro-batch sizes ({exc}); "
                             "its forward pass takes different code paths at micro-batch 1 and 2") from exc
        except (RuntimeError, TypeError, AssertionError, ArithmeticError, MicroBatchTooSmall) as exc:
            # the model's own step fails under this variant (an fp32 input meeting bf16 weights, say): the
            # candidates that need it cannot run, which is the planner's to report, not a crash
            self._failed[key] = f"{STEP_FAILS}{key.label()} ({describe_step_failure(exc)})"
            raise VariantFailed(self._failed[key]) from exc
        for t in traces:
            self.variants[t.key] = t
        bounded = sorted({op for t in traces for op in t.bounded_ops})
        if bounded:
            note = (f"{', '.join(bounded)}: output size depends on values; traced at its largest (every element "
                    "selected, every value distinct), which over-estimates batches that select fewer or repeat "
                    "values")
            if note not in self.notes:
                self.notes.append(note)
        reads = max(t.value_reads for t in traces)
        if reads:
            note = (f"the training step reads floating values the trace cannot know ({reads} in its micro-batch: a "
                    f"loss logged with .item(), say); traced with {FLOAT_READ_STAND_IN} for each, so a step whose "
                    "memory depends on them is estimated for that value")
            if not any(n.startswith("the training step reads floating values") for n in self.notes):
                self.notes.append(note)
        took = time.perf_counter() - start
        self.trace_s += took
        progress.report(f"traced {key.label()} in {took:.1f} s")
        self._save()
        return traces[0]

    def optimizer(self, precision: str, optimizer: str, variant: VariantTrace | None = None) -> OptimizerTrace:
        """The optimizer step of ``precision`` and ``optimizer`` over the model's trainable parameters; with a
        ``variant`` that transforms the model (extras), over that variant's trainable parameters at full depth."""
        extras = variant.key.extras_id if variant is not None and variant.model_state is not None else ""
        if optimizer != "user":
            why = variant_of(optimizer).refusal(self.trainable_dtypes, self.model_class)
            if why is not None:
                raise ValueError(f"optimizer {optimizer!r} cannot train this model: {why}")
        key = (precision, optimizer, extras)
        if key not in self.optimizers:
            twin = self._optimizer_twin(precision, optimizer, extras)
            if twin is not None:
                self.optimizers[key] = dataclasses.replace(twin, precision=precision)
                self._save()
                return self.optimizers[key]
            if optimizer == "user" and self._optimizer_spec is None:
                raise ValueError("optimizer 'user' needs the optimizer callable passed to memopt.profile/plan")
            start = time.perf_counter()
            if extras:
                assert variant is not None
                if self._policy is None:
                    raise ValueError(f"the profile has no trace of the optimizer {optimizer!r} with {precision} "
                                     f"over {variant.key.label()}; profile the model again to trace it")
                layout = (variant.model_state, variant.traced_blocks, self.full_block_counts)
                trace = self._trace_optimizer(precision, optimizer, layout)
                self.optimizers[key] = dataclasses.replace(trace, extras=extras)
            else:
                model = self.model()
                if model is None or self._policy is None:
                    raise ValueError(f"the profile has no trace of the optimizer {optimizer!r} with {precision}; "
                                     "profile the model again to trace it")
                layout = model_layout(model, weight_dtype(precision)) if optimizer != "user" else None
                self.optimizers[key] = (trace_optimizer(model, precision, optimizer, self._policy,
                                                        optimizer_spec=self._optimizer_spec)
                                        if layout is None else self._trace_optimizer(precision, optimizer, layout))
            self.trace_s += time.perf_counter() - start
            self._save()
        return self.optimizers[key]

    def _trace_optimizer(self, precision: str, optimizer: str,
                         layout: tuple[dict[str, Any], list[int], list[int]]) -> OptimizerTrace:
        """The optimizer step over the trainable parameters of a model state ``(state, traced_blocks,
        full_counts)``: extrapolated from shallow copies (``memopt.profile.optimizer_scaling``) except for a user
        optimizer, which is traced over the full list."""
        assert self._policy is not None
        policy, spec = self._policy, self._optimizer_spec

        def trace(params: list[tuple[tuple[int, ...], str]]) -> OptimizerTrace:
            return trace_optimizer(None, precision, optimizer, policy, optimizer_spec=spec, params=params)

        if optimizer == "user":
            return trace(trainable_params(*layout))
        return scaled_optimizer_trace(*layout, trace)

    def _optimizer_twin(self, precision: str, optimizer: str, extras: str = "") -> OptimizerTrace | None:
        """A recorded trace of ``optimizer`` under a precision whose optimizer step is the same code on the same
        tensors (see :func:`optimizer_step_class`), or None. A user optimizer is always traced. With extras
        the parameters are the variant's own (in their final dtypes): only the same precision group shares them."""
        if optimizer == "user":
            return None
        cls = optimizer_step_class(precision)
        for (other, opt, ex), trace in self.optimizers.items():
            if opt == optimizer and ex == extras and other != precision and optimizer_step_class(other) == cls \
                    and (not extras or PRECISION_GROUP[other] == PRECISION_GROUP[precision]):
                return trace
        return None

    def model_state(self, variant: VariantTrace) -> tuple[list[tuple[tuple[int, ...], str, bool]],
                                                          list[tuple[tuple[int, ...], str]]]:
        """The full model's parameters ``(shape, dtype, trainable)`` and buffers ``(shape, dtype)`` as ``variant``
        transforms it (recorded by variants with extras only)."""
        if variant.model_state is None:
            raise ValueError(f"the trace of {variant.key.label()} records no model state")
        cached = variant.__dict__.get("_full_state")
        if cached is None:
            cached = variant.__dict__["_full_state"] = expand_model_state(
                variant.model_state, variant.traced_blocks, self.full_block_counts)
        return cached

    # -- serialization -------------------------------------------------------------------------
    @property
    def batch_factory(self) -> BatchFactory | None:
        """``(samples, device) -> batch`` with the sample's structure and per-sample shapes (None: a profile loaded
        from the cache and not attached to a model)."""
        return self._batch_factory

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version, "key": self.key, "model_name": self.model_name,
            "model_class": self.model_class, "family": self.family, "num_params": self.num_params,
            "num_trainable_params": self.num_trainable_params, "param_sizes": self.param_sizes,
            "buffer_sizes": self.buffer_sizes, "params_by_module": self.params_by_module, "stacks": self.stacks,
            "sample": self.sample, "tokens_per_sample": self.tokens_per_sample, "hardware": self.hardware,
            "kernel_policy": self.kernel_policy, "torch_version": self.torch_version,
            "variants": [v.to_dict() for v in self.variants.values()],
            "optimizers": [o.to_dict() for o in self.optimizers.values()],
            "moe": self.moe, "analytic": self.analytic, "notes": self.notes, "trace_s": self.trace_s,
            "vocab_size": self.vocab_size, "engine_facts": self.engine_facts,
            "chunked_ce_refusal": self.chunked_ce_refusal, "liger_ce_refusal": self.liger_ce_refusal,
            "micro_batch_refusal": self.micro_batch_refusal, "forward_random_ops": self.forward_random_ops,
            "recurrent_layers": self.recurrent_layers, "whole_batch": self.whole_batch,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ValueError(f"profile schema version {version} is not the supported {SCHEMA_VERSION}; "
                             "profile the model again")
        variants = {t.key: t for t in (VariantTrace.from_dict(v) for v in d["variants"])}
        optimizers = {}
        for o in d["optimizers"]:
            t = OptimizerTrace.from_dict(o)
            optimizers[(t.precision, t.optimizer, t.extras)] = t
        return cls(key=d["key"], model_name=d["model_name"], model_class=d["model_class"], family=d.get("family"),
                   num_params=d["num_params"], num_trainable_params=d["num_trainable_params"],
                   param_sizes=[tuple(x) for x in d["param_sizes"]],
                   buffer_sizes=[tuple(x) for x in d["buffer_sizes"]], params_by_module=d["params_by_module"],
                   stacks=d["stacks"], sample=d["sample"], tokens_per_sample=d.get("tokens_per_sample"),
                   hardware=d["hardware"], kernel_policy=d["kernel_policy"], torch_version=d["torch_version"],
                   variants=variants, optimizers=optimizers, moe=d.get("moe"), analytic=d.get("analytic", False),
                   notes=list(d.get("notes", [])), trace_s=d.get("trace_s", 0.0), vocab_size=d.get("vocab_size"),
                   engine_facts=d.get("engine_facts"), chunked_ce_refusal=d.get("chunked_ce_refusal"),
                   liger_ce_refusal=d.get("liger_ce_refusal"), micro_batch_refusal=d.get("micro_batch_refusal"),
                   forward_random_ops=d.get("forward_random_ops"), recurrent_layers=d.get("recurrent_layers", []),
                   whole_batch=d.get("whole_batch"))

    def save(self, path: str | os.PathLike[str]) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{path}.{os.getpid()}.tmp")  # one per process: the ranks of one job share the cache
        tmp.write_text(json.dumps(self.to_dict()))
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        return cls.from_dict(json.loads(Path(path).read_text()))

    @contextlib.contextmanager
    def batched_saves(self) -> Iterator[Profile]:
        """Within this block, traces added to a cached profile are written to the cache once, when it ends (the
        3 MB JSON of a 70B model is not rewritten after each of a plan's traces)."""
        self._saves_held += 1
        try:
            yield self
        finally:
            self._saves_held -= 1
            if not self._saves_held and self._save_pending:
                self._save()

    def _save(self) -> None:
        if self._saves_held:
            self._save_pending = True
            return
        self._save_pending = False
        if self._cache_path is not None:
            try:
                self.save(self._cache_path)
            except OSError:
                pass  # a read-only cache is no reason to fail a plan

    def attach(self, model: nn.Module | Callable[[], nn.Module], batch_factory: BatchFactory, policy: KernelPolicy,
               loss_fn: Any = None, optimizer_spec: Any = None, cache_path: Path | None = None) -> Profile:
        """What tracing a missing variant needs. ``model`` is the module, or a function that builds it (called
        the first time a trace is needed)."""
        if isinstance(model, nn.Module):
            self._model, self._model_builder = model, None
        else:
            self._model, self._model_builder = None, model
        self._batch_factory, self._policy = batch_factory, policy
        self._loss_fn, self._optimizer_spec, self._cache_path = loss_fn, optimizer_spec, cache_path
        return self

    def summary(self) -> dict[str, Any]:
        return {"model": self.model_name, "num_params": self.num_params,
                "num_trainable_params": self.num_trainable_params,
                "stacks": [{k: s[k] for k in ("path", "num_blocks", "block_class")} for s in self.stacks],
                "sample": self.sample, "variants": [k.label() for k in self.variants], "moe": self.moe,
                "analytic": self.analytic, "notes": self.notes}


def is_float_dtype(dtype: str) -> bool:
    return dtype in ("float32", "float16", "bfloat16", "float64")


def optimizer_step_class(precision: str) -> tuple[str, bool, bool]:
    """What of the precision the optimizer step sees: the weights' dtype, a gradient scaler, fp32 master weights.
    Precisions of one class run the same optimizer step on the same tensors (``trace_optimizer`` reads nothing
    else of the precision), so one trace serves them all (fp32 and bf16 autocast: fp32 weights, no scaler)."""
    return str(weight_dtype(precision)), uses_grad_scaler(precision), precision == "bf16_master"


_ = (Callable, HardwareSpec)
