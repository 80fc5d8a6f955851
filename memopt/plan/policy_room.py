"""Whether a policy leaves the search anything to choose, checked before anything is traced. A technique whose every
value the policy forbids (or the fidelity does not allow) leaves no candidate at all: the search would trace the
model and then report that nothing fits, naming a strategy the policy forbids. Each technique's values are taken
from its registry entry under the most permissive model (a causal LM with blocks to checkpoint, every optional
package present where the hardware runs it), so a technique refused here has no value for any model; a value the
model later refuses is the planner's to report. Packages are taken as installed here (a backend of a package that
is missing is no value the search could use)."""

from __future__ import annotations

from typing import Any

from memopt.hardware import HardwareSpec
from memopt.plan.policy import Policy, fidelity_of
from memopt.techniques.attention import SDPA_BACKENDS, flash_attn_available
from memopt.techniques.optimizers import bnb_installed
from memopt.techniques.protocol import SearchContext
from memopt.techniques.registry import TECHNIQUES

__all__ = ["check_micro_batch_room", "check_policy_room"]

# the micro-batch sizes depend on the batch: check_micro_batch_room weighs them once the batch is known
_SKIPPED = ("micro_batch_size",)


def _widest_context(hw: HardwareSpec, policy: Policy, user_optimizer: bool) -> SearchContext:
    # every backend the search may fall back on (memopt.plan.policy.attention_backends), so that forbidding them
    # all is named here
    backends = ("auto", *SDPA_BACKENDS) if "attention" not in policy.pins else (policy.pins["attention"],)
    return SearchContext(global_batch=1, block_counts=(8,), supports_bf16=hw.supports_bf16, causal_lm=True,
                         vocab_size=None, bnb_available=bnb_installed(), flash_attn_available=flash_attn_available(),
                         user_optimizer=user_optimizer, attention_backends=backends, liger_ce=True)


def _allowed(policy: Policy, name: str, value: Any) -> bool:
    """As the search filters the entry's options (``memopt.plan.search.candidates``)."""
    if name == "checkpointing":
        mode, blocks = policy.pins.get("checkpointing"), policy.pins.get("checkpoint_blocks")
        return ((mode is None or value.mode == mode) and value.mode not in policy.forbid.get("checkpointing", ())
                and (blocks is None or (blocks == 0) == (value.mode == "none")))
    return policy.allows(name, value)


def _shown(name: str, value: Any) -> str:
    """A value as the policy's forbid names it (a checkpointing mode, not its block count)."""
    return value.mode if name == "checkpointing" else str(value)


def check_policy_room(policy: Policy, hw: HardwareSpec, problems: list[str], *, user_optimizer: bool) -> None:
    """One line per technique the policy leaves no value of: what the fidelity allows on ``hw``, what is forbidden,
    and what would open it."""
    ctx = _widest_context(hw, policy, user_optimizer)
    for tech in TECHNIQUES:
        if tech.name in _SKIPPED or tech.name in policy.pins:  # a pin is its own option, checked where it is read
            continue
        values = tech.options(ctx)
        if not values or any(_allowed(policy, tech.name, v) for v in values):
            continue
        named = {_shown(tech.name, v): v for v in values}
        banned = {str(f) for f in policy.forbid.get(tech.name, ())}
        forbidden = [s for s in named if s in banned]
        needs: dict[str, list[str]] = {}
        for s, v in named.items():
            if s not in banned and fidelity_of(tech.name, v) not in policy.allow:
                needs.setdefault(fidelity_of(tech.name, v), []).append(s)
        widen = "; ".join(f"{', '.join(vs)} need{'s' if len(vs) == 1 else ''} {a!r}" for a, vs in needs.items())
        problems.append(f"the policy leaves no {tech.name} to plan on {hw.name}: of {', '.join(named)} it forbids "
                        f"{', '.join(forbidden) or 'nothing'}, and the fidelity ({', '.join(sorted(policy.allow))}) "
                        f"allows no other; un-forbid one" + (f", or widen the fidelity ({widen})" if widen else ""))


def check_micro_batch_room(policy: Policy, batch: Any, problems: list[str], *, batch_key: str = "batch_size") -> None:
    """One line when the policy leaves no micro-batch size for ``batch`` (the batch of one GPU): the sizes that divide
    it, at most ``max_micro_batch``, are all forbidden. A pinned size is checked against the batch elsewhere
    (``memopt.plan.checks.check_global_batch_pins``)."""
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1 or "micro_batch_size" in policy.pins:
        return
    sizes = [b for b in range(1, batch + 1) if batch % b == 0
             and (policy.max_micro_batch is None or b <= policy.max_micro_batch)]
    if any(policy.allows("micro_batch_size", b) for b in sizes):
        return
    cap = f" up to max_micro_batch={policy.max_micro_batch}" if policy.max_micro_batch is not None else ""
    problems.append(f"the policy leaves no micro_batch_size for the batch of {batch} ({batch_key}): it forbids every "
                    f"size that divides it{cap} ({', '.join(map(str, sizes)) or 'none'}); un-forbid one"
                    + (", or raise max_micro_batch" if cap else "") + ", or change the batch")
