"""``memopt.profile(model, sample=...)``: resolve what the user passed, then trace or load from the cache."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from memopt.blocks import scripted_stacks
from memopt.errors import InputError, as_input_errors
from memopt.hardware import HardwareSpec, load_hardware
from memopt.models import ModelSpec, build_model, load_model_spec
from memopt.models.hf_task import hf_task
from memopt.models.sample import config_vocab_size
from memopt.profile.batch_factories import (
    batch_factory_for,
    spec_batch_factory,
    whole_batch_factory,
)
from memopt.profile.cache_keys import cache_dir, spec_key, structure_key
from memopt.profile.cuda_semantics import kernel_policy_for
from memopt.profile.engine_facts import facts_of_module
from memopt.profile.head_probe import head_refusal
from memopt.profile.loss_key import loss_key
from memopt.profile.profile import Profile, VariantFailed
from memopt.profile.sample_axis_probe import probe_batch, runs_whole_batch_only
from memopt.profile.static_facts import static_facts
from memopt.profile.trace import BatchFactory, meta_failures_unlogged
from memopt.profile.tracing_flag import tracing
from memopt.profile.variant_trace import VariantKey
from memopt.step import batch_samples
from memopt.step.batch import as_loss
from memopt.techniques.liger_ce import liger_installed, liger_refusal
from memopt.techniques.micro_batching import micro_batch_refusal

__all__ = ["default_variant", "lazy_module_refusal", "profile_model", "resolve_model"]


def lazy_module_refusal(model: nn.Module) -> str | None:
    """Why ``model`` cannot be planned while it has lazy modules (``nn.LazyLinear``, ...) a forward has not
    initialised: their parameters have no shape yet, and the profile's fake-tensor forward cannot give them one
    (initialising them with a real forward is the user's, on a batch of theirs)."""
    lazy = [f"{name or '(root)'} ({type(m).__name__})" for name, m in model.named_modules()
            if any(is_lazy(t) for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)))]
    if not lazy:
        return None
    return (f"the model has lazy modules a forward has not initialised yet ({', '.join(lazy[:3])}"
            f"{', ...' if len(lazy) > 3 else ''}): their parameters have no shape to plan for; run one forward on a "
            "real batch first (model(batch)) to initialise them, then wrap or plan the model")


def resolve_model(model: Any) -> tuple[nn.Module, Any, str]:
    """(module on meta or as given, model spec or None, display name) from a module, a shipped config name,
    a YAML path, a spec dict, or a Hydra ``{'_target_': ...}`` node."""
    if isinstance(model, nn.Module):
        refusal = lazy_module_refusal(model)
        if refusal is not None:
            raise InputError([refusal])
        return model, None, type(model).__name__
    if isinstance(model, dict) and "_target_" in model:
        import hydra.utils

        with torch.device("meta"):
            module = hydra.utils.instantiate(model)
        if not isinstance(module, nn.Module):
            raise ValueError(f"_target_ {model['_target_']!r} built a {type(module).__name__}, not a torch.nn.Module")
        return module, None, str(model["_target_"]).rsplit(".", 1)[-1]
    if isinstance(model, (str, dict, ModelSpec)):
        spec = load_model_spec(model)
        return build_model(spec, device="meta"), spec, spec.name
    raise ValueError(
        f"cannot profile a {type(model).__name__}: pass a torch.nn.Module, a shipped model name "
        "(e.g. 'llama3_8b'; see configs/model/), a model YAML path, or a Hydra node with _target_"
    )


def default_variant(hardware: HardwareSpec) -> VariantKey:
    return VariantKey(precision="amp" if hardware.supports_bf16 else "fp32", checkpointing="none")


def _shipped_spec(model: Any) -> Any:
    """The model spec when ``model`` names one (a shipped name, a YAML path, a spec dict or ``ModelSpec``), else
    None (a module or a Hydra ``_target_`` node: those are keyed on the built module's structure)."""
    if isinstance(model, (ModelSpec, str)) or (isinstance(model, dict) and "_target_" not in model):
        return load_model_spec(model)
    return None


def _lazy_builder(spec: Any) -> Callable[[], nn.Module]:
    """Builds the spec's model on meta the first time it is called (tracing needs it; a cached profile does not)."""
    built: list[nn.Module] = []

    def build() -> nn.Module:
        if not built:
            built.append(build_model(spec, device="meta"))
        return built[0]

    return build


def _load_cached(path: Path) -> Profile | None:
    try:
        return Profile.load(path)
    except (ValueError, KeyError, OSError):
        return None  # a stale or damaged cache entry is traced again


def _new_profile(module: nn.Module, spec: Any, name: str, key: str, sample_dict: dict[str, Any],
                 tokens: int | None, hw: HardwareSpec, policy_key: str) -> Profile:
    facts = static_facts(module)
    prof = Profile(key=key, model_name=name, model_class=type(module).__name__,
                   family=spec.family if spec is not None else hf_task(module), sample=sample_dict,
                   tokens_per_sample=tokens, hardware=hw.name, kernel_policy=policy_key,
                   torch_version=torch.__version__, moe=_moe_facts(module), vocab_size=_vocab_size(module),
                   engine_facts=_engine_facts(module), **facts)
    _record_micro_batch_refusal(prof, module)
    if sample_dict.get("indivisible"):
        prof.notes.append(f"{sample_dict['indivisible']}, {batch_samples.TRAINED_WHOLE}")
    for path in scripted_stacks(module):
        prof.notes.append(f"{path}: its blocks are torch.jit.script-ed and take no hooks, so they are not checkpointed "
                          "(leave the blocks eager, or script the code inside them, to let memopt checkpoint them)")
    for stack in prof.stacks:
        if not stack["uniform_tail"]:
            prof.notes.append(f"{stack['path']}: blocks differ after the first; the whole stack is traced")
    if prof.family == "causal_lm":
        prof.chunked_ce_refusal = head_refusal(module)
        prof.liger_ce_refusal = liger_refusal(module, prof.chunked_ce_refusal)
        if prof.chunked_ce_refusal:
            prof.notes.append(f"chunked cross-entropy refused (it would not be exact): {prof.chunked_ce_refusal}")
        elif prof.liger_ce_refusal and liger_installed():
            prof.notes.append(f"Liger's fused cross-entropy refused (it would not be exact): {prof.liger_ce_refusal}")
    return prof


def _engine_facts(module: nn.Module) -> dict[str, Any] | None:
    """The parameter counts the sharding planner needs (so it never rebuilds the model from a cached profile)."""
    import dataclasses

    try:
        return dataclasses.asdict(facts_of_module(module))
    except ValueError:  # no parameters: nothing to shard
        return None


def _vocab_size(module: nn.Module) -> int | None:
    config = getattr(module, "config", None)
    return None if config is None else config_vocab_size(config)


def _record_micro_batch_refusal(prof: Profile, module: nn.Module, probed: str | None = None) -> None:
    """The profile's word on micro-batching: the module's batch-coupled layers (a static fact, so a cached profile
    gets it too), else what the sample-axis probe found for this batch layout (``probed``; a cached profile, keyed on
    the same structure and sample, keeps the probe's word)."""
    prof.recurrent_layers = [name or "(root)" for name, m in module.named_modules() if isinstance(m, nn.RNNBase)]
    reason = micro_batch_refusal(module) or probed
    if reason == prof.micro_batch_refusal:
        return
    prof.micro_batch_refusal = reason
    if reason is not None and int(prof.sample.get("batch_size", 1)) > 1:
        how = ("the batch is traced and trained whole, in one micro-batch" if prof.whole_batch
               else "pin micro_batch_size to split the batch anyway")
        prof.notes.append(f"micro-batching refused (it would not be exact): {reason}; {how}")


def _loss_part(loss_fn: Any) -> dict[str, str]:
    """The loss's part of the profile key: the model's own loss adds nothing, so keys made before the loss was part
    of them stay valid for it."""
    return {} if loss_fn is None else {"loss": loss_key(loss_fn)}


def _note_user_hooks(prof: Profile, module: nn.Module) -> None:
    """A note when the model carries forward hooks: they run in the trace too, on fake tensors (their memory counts),
    so a hook that keeps what it sees would keep tensors without values; and one when its parameters carry gradient
    hooks, which micro-batching runs per micro-batch."""
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules())
    if hooks:
        note = (f"the model's {hooks} forward hook(s) ran on fake tensors (no values) while memopt traced the step; "
                "a hook that keeps what it sees (features, logged values) can skip while memopt.is_tracing()")
        if note not in prof.notes:
            prof.notes.append(note)
    hooked = [name for name, p in module.named_parameters() if getattr(p, "_backward_hooks", None)]
    if hooked:
        # a hook sees each micro-batch's gradient before they are summed: h(g1) + h(g2) is h(g1 + g2) only for a
        # linear h, which memopt cannot tell from a clip
        note = (f"{len(hooked)} parameter(s) ({', '.join(hooked[:3])}{', ...' if len(hooked) > 3 else ''}) carry "
                "gradient hooks (register_hook): under micro-batching each runs on every micro-batch's gradient, "
                "which is exact for a linear hook (scaling, masking) but not for one that clips or normalizes")
        if note not in prof.notes:
            prof.notes.append(note)


def _probe_batch(prof: Profile, module: nn.Module, factory: BatchFactory, loss_fn: Any) -> None:
    """What splitting the batch does to the model (``memopt.profile.sample_axis_probe``), for a batch that can be
    split."""
    batch = int(prof.sample.get("batch_size", 1))
    if batch < 2:
        return
    probe = probe_batch(module, factory, loss_fn, batch)
    if probe is None:
        return
    prof.forward_random_ops = list(probe.random_ops)
    prof.whole_batch = probe.whole_batch
    refusal = probe.axis_refusal or probe.state_refusal
    if probe.whole_batch:
        refusal = f"{refusal}; {probe.whole_batch}"
    _record_micro_batch_refusal(prof, module, refusal)


def profile_model(model: Any, sample: Any = None, *, hardware: str | HardwareSpec | None = None,
                  loss_fn: Any = None, optimizer: Any = None, use_cache: bool = True,
                  variants: list[VariantKey] | None = None, training_step: Any = None) -> Profile:
    """Profile ``model`` for ``sample`` on ``hardware`` (see :class:`Profile`); the first variant is traced now.

    A model spec (shipped name, YAML, dict) is keyed on the spec itself: a cached profile is found without
    building the model, which is built (on meta) only when a trace is missing.
    """
    with meta_failures_unlogged(), tracing():  # its probes run the model on fake tensors too, before any trace
        return _profile_model(model, sample, hardware=hardware, loss_fn=loss_fn, optimizer=optimizer,
                              use_cache=use_cache, variants=variants, training_step=training_step)


def _profile_model(model: Any, sample: Any, *, hardware: str | HardwareSpec | None, loss_fn: Any, optimizer: Any,
                   use_cache: bool, variants: list[VariantKey] | None, training_step: Any) -> Profile:
    if training_step is not None:  # (model, batch) -> loss: the batch contract of memopt.step.batch
        loss_fn = as_loss(loss_fn, training_step)
    source: nn.Module | Callable[[], nn.Module]
    with as_input_errors():  # what the user passed, read: a ValueError here names their model, sample or GPU
        hw = load_hardware(hardware)
        policy = kernel_policy_for(hw)
        spec = _shipped_spec(model)
        if spec is not None:
            build = _lazy_builder(spec)
            name = spec.name
            factory, sample_dict, tokens = spec_batch_factory(spec, sample, lambda: getattr(build(), "config", None))
            key = spec_key(spec, {"sample": sample_dict, "policy": policy.cache_key, **_loss_part(loss_fn)})
            source = build
        else:
            module, spec, name = resolve_model(model)
            factory, sample_dict, tokens = batch_factory_for(spec, sample, module)
            key = structure_key(module, {"sample": sample_dict, "policy": policy.cache_key,
                                         **getattr(factory, "key_part", {}), **_loss_part(loss_fn)})
            source = module
    path = cache_dir() / "profiles" / f"{key}.json"
    prof = _load_cached(path) if use_cache and path.exists() else None
    if prof is None:
        module = source if isinstance(source, nn.Module) else source()
        prof = _new_profile(module, spec, name, key, sample_dict, tokens, hw, policy.cache_key)
        _probe_batch(prof, module, factory, loss_fn)
    else:
        if isinstance(source, nn.Module):
            _record_micro_batch_refusal(prof, source, prof.micro_batch_refusal)
        if prof.forward_random_ops is None:  # cached before the batch probe was recorded
            _probe_batch(prof, source if isinstance(source, nn.Module) else source(), factory, loss_fn)
    if isinstance(source, nn.Module):
        _note_user_hooks(prof, source)
    batch = int(sample_dict.get("batch_size", 1))
    if prof.whole_batch:
        factory = whole_batch_factory(factory, batch)
    prof.attach(source, factory, policy, loss_fn=loss_fn, optimizer_spec=optimizer,
                cache_path=path if use_cache else None)
    start = time.perf_counter()
    for v in variants or [default_variant(hw)]:
        try:
            try:
                prof.variant(v, micro_batch=batch)
            except VariantFailed:
                if variants or v.precision == "fp32":
                    raise
                # a model without bf16 kernels for some op may still train in fp32; the planner refuses the rest
                prof.variant(dataclasses.replace(v, precision="fp32"), micro_batch=batch)
        except ValueError as exc:  # VariantFailed, or a ValueError the model's own step raised (a target's size)
            if isinstance(source, nn.Module) and runs_whole_batch_only(source, factory, loss_fn, batch):
                raise ValueError(
                    f"{name} trains on the whole batch of {batch} but not on one sample of it ({exc}): memopt profiles "
                    "the step at 1 and 2 samples along the first dimension of every batch tensor and scales it to the "
                    "batch, so it plans models whose batch's first dimension is independent samples, which this "
                    "one's is not (a whole graph's nodes and their adjacency, say)"
                    f"{_lists_hint(sample)}") from exc
            raise
    prof.trace_s = max(prof.trace_s, time.perf_counter() - start) if not prof.trace_s else prof.trace_s
    return prof


def _lists_hint(sample: Any) -> str:
    """Where the batch holds lists not as long as its samples (handed whole to every sample): their names."""
    try:
        lists = batch_samples.unsplit_lists(sample)
    except ValueError:
        return ""
    return f"; or the batch's lists {', '.join(lists)} are not one item per sample" if lists else ""


def _moe_facts(module: nn.Module) -> dict[str, Any] | None:
    config = getattr(module, "config", None)
    experts = getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None)
    if not experts:
        return None
    impl = getattr(config, "_experts_implementation", None) or "grouped_mm"
    top_k = getattr(config, "num_experts_per_tok", None)
    return {
        "num_experts": experts, "top_k": top_k, "experts_implementation": impl,
        "routing": ("independent of routing: transformers' grouped GEMM runs every token's top-k experts as one "
                    "batch of tokens x top_k rows, so memory does not depend on how tokens are spread"
                    if impl == "grouped_mm" else "balanced routing assumed (capacity factor 1.0)"),
        "capacity_factor": 1.0,
    }

