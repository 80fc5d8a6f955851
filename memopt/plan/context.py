"""What a plan is searched for: the hardware spec, the policy, and the search context of a profile."""

from __future__ import annotations

from typing import Any

from memopt.errors import InputError
from memopt.hardware import HardwareSpec, load_hardware
from memopt.plan.policy import Policy, attention_backends
from memopt.profile.profile import Profile
from memopt.profile.sample_axis_probe import random_draws_refusal
from memopt.techniques.adapters import peft_installed
from memopt.techniques.attention import flash_attn_available
from memopt.techniques.extras import adapters_refusal
from memopt.techniques.liger_ce import liger_installed
from memopt.techniques.optimizers import VARIANTS, bnb_installed
from memopt.techniques.protocol import SearchContext

__all__ = ["micro_batch_refusal_for", "optimizer_refusals", "refused_optimizer_notes", "resolve_hardware",
           "resolve_policy", "search_context"]


def resolve_hardware(hardware: str | HardwareSpec | dict | None) -> HardwareSpec:
    """The spec to plan for: a shipped name, a dict, a spec; ``"auto"`` the local GPU (an error without one); None
    the local GPU or, when none is visible, ``memopt.hardware.DEFAULT_HARDWARE`` (the plan's notes say so)."""
    return load_hardware(hardware)


def resolve_policy(policy: Policy | dict[str, Any] | None, **overrides: Any) -> Policy:
    if isinstance(policy, Policy) and not any(v is not None for v in overrides.values()):
        return policy
    data: dict[str, Any] = {}
    if isinstance(policy, Policy):
        data = {"fidelity": sorted(policy.allow), "pins": policy.pins, "forbid": policy.forbid,
                "max_micro_batch": policy.max_micro_batch}
    elif isinstance(policy, dict):
        data = dict(policy)
    elif policy is not None:
        raise ValueError(f"policy must be a memopt Policy or a dict, got {type(policy).__name__}")
    data.update({k: v for k, v in overrides.items() if v is not None})
    return Policy.build(**data)


def liger_ce_unavailable(profile: Profile, hw: HardwareSpec) -> str | None:
    """Why Liger's fused linear cross-entropy cannot be planned here (None: it can)."""
    if not liger_installed():
        return "liger-kernel and triton are not installed (pip install liger-kernel)"
    if tuple(hw.compute_capability) < (8, 0):
        return f"{hw.name} (compute capability {hw.compute_capability}) is older than the Ampere GPUs Liger targets"
    if profile.family != "causal_lm":
        return "the model is not a causal LM"
    return profile.chunked_ce_refusal or profile.liger_ce_refusal


def micro_batch_refusal_for(profile: Profile, policy: Policy) -> str | None:
    """Why micro-batches would not be exact for this model under ``policy``: the profile's word (batch-coupled
    layers, a batch whose dim 0 is not the samples), and under the "exact" fidelity alone also random draws in the
    training forward (micro-batches draw other masks than one pass over the whole batch; the fidelities that allow
    bf16 autocast already trade bitwise equality for speed)."""
    if profile.micro_batch_refusal or policy.allow != {"exact"} or not profile.forward_random_ops:
        return profile.micro_batch_refusal
    return random_draws_refusal(profile.forward_random_ops)


def optimizer_refusals(profile: Profile) -> tuple[tuple[str, str], ...]:
    """(optimizer, why) for each registered optimizer that cannot step the model's trainable parameters."""
    found = ((v.name, v.refusal(profile.trainable_dtypes, profile.model_class)) for v in VARIANTS.values())
    return tuple((name, why) for name, why in found if why is not None)


def refused_optimizer_notes(ctx: SearchContext, policy: Policy) -> list[str]:
    """The plan's word on each optimizer it would have weighed but refused for this model, and on what took its
    place. A pinned one that is refused is an error instead (``memopt.plan.planner``)."""
    notes = []
    for name, why in ctx.optimizer_refusals:
        v = VARIANTS[name]
        if ctx.user_optimizer or not v.offered or not ctx.has(v.requires) or not policy.allows("optimizer", name):
            continue
        instead = f"; {v.instead} (the same update) is planned in its place" if v.instead else ""
        notes.append(f"optimizer {name} refused: {why}{instead}")
    return notes


def search_context(profile: Profile, hw: HardwareSpec, global_batch: int, policy: Policy,
                   user_optimizer: bool) -> SearchContext:
    vocab = profile.vocab_size
    if vocab is None:  # a profile saved before the vocabulary was recorded: ask its model, if one is at hand
        vocab = getattr(getattr(profile._model, "config", None), "vocab_size", None)
    backends = attention_backends(policy)
    liger = liger_ce_unavailable(profile, hw)
    if liger and policy.pins.get("ce_kernel") == "liger":
        raise InputError([f"pin ce_kernel='liger' cannot be honoured: {liger}; pin ce_kernel='memopt' or drop it"])
    return SearchContext(global_batch=global_batch, block_counts=tuple(profile.full_block_counts),
                         supports_bf16=hw.supports_bf16, vocab_size=vocab,
                         causal_lm=profile.family == "causal_lm" and not profile.chunked_ce_refusal,
                         bnb_available=bnb_installed(), flash_attn_available=flash_attn_available(),
                         peft_available=peft_installed(), adapters_refusal=adapters_refusal(profile.model_class),
                         liger_ce=liger is None,
                         user_optimizer=user_optimizer, attention_backends=backends,
                         max_micro_batch=policy.max_micro_batch,
                         micro_batch_refusal=micro_batch_refusal_for(profile, policy),
                         optimizer_refusals=optimizer_refusals(profile))
