"""Whether a policy leaves the search anything to choose, checked before anything is traced. A technique whose every
value the policy forbids (or the fidelity does not allow) leaves no candidate at all: the search would trace the
model and then report that nothing fits, naming a strategy the policy forbids. Each technique's values are taken
from its registry entry under the most permissive model (a causal LM with blocks to checkpoint, every optional
package present where the hardware runs it), so a technique refused here has no value for any model; a value the
model later refuses is the planner's to report."""

from __future__ import annotations

from typing import Any

from memopt.hardware import HardwareSpec
from memopt.plan.policy import Policy, fidelity_of
from memopt.techniques.optimizers import bnb_installed
from memopt.techniques.protocol import SearchContext
from memopt.techniques.registry import TECHNIQUES

__all__ = ["check_policy_room"]

# the micro-batch sizes depend on the batch, which the batch pins' own check covers
_SKIPPED = ("micro_batch_size",)


def _widest_context(hw: HardwareSpec, policy: Policy, user_optimizer: bool) -> SearchContext:
    backends = ("auto",) if "attention" not in policy.pins else (policy.pins["attention"],)
    return SearchContext(global_batch=1, block_counts=(8,), supports_bf16=hw.supports_bf16, causal_lm=True,
                         vocab_size=None, bnb_available=bnb_installed(), flash_attn_available=True,
                         user_optimizer=user_optimizer, attention_backends=backends, liger_ce=True)


def _allowed(policy: Policy, name: str, value: Any) -> bool:
    """As the search filters the entry's options (``memopt.plan.search.candidates``)."""
    if name == "checkpointing":
        mode = policy.pins.get("checkpointing")
        return (mode is None or value.mode == mode) and value.mode not in policy.forbid.get("checkpointing", ())
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
