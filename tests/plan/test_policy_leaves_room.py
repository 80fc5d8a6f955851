"""A policy narrows the search, never empties it into another plan: a forbidden value is in no plan (one GPU or
sharded), a pin of 0 checkpointed blocks is the plan without checkpointing, and a policy that leaves a technique no
value is refused in one line before anything is traced."""

from __future__ import annotations

import pytest

import memopt
from memopt.errors import InputError
from memopt.hardware import load_hardware
from memopt.plan import Policy
from memopt.plan.policy import attention_backends
from memopt.plan.policy_room import check_micro_batch_room, check_policy_room
from memopt.plan.search import candidates
from memopt.techniques.protocol import SearchContext

HW = load_hardware("h100_80gb")


def _ctx(policy: Policy, batch: int = 4) -> SearchContext:
    return SearchContext(global_batch=batch, block_counts=(4,), supports_bf16=True, causal_lm=True, vocab_size=None,
                         bnb_available=False, flash_attn_available=False, user_optimizer=False,
                         attention_backends=attention_backends(policy))


def test_forbidding_auto_attention_searches_the_named_backends():
    policy = Policy.build(forbid={"attention": ["auto"]})
    cands = candidates(_ctx(policy), policy)
    assert cands, "forbidding one attention value left no candidate"
    used = {s.attention for s in cands}
    assert "auto" not in used and {"flash", "efficient", "math"} <= used
    problems: list[str] = []
    check_policy_room(policy, HW, problems, user_optimizer=False)
    assert problems == []


def test_forbidding_every_attention_backend_is_refused_before_tracing():
    policy = Policy.build(forbid={"attention": ["auto", "flash", "efficient", "cudnn", "math"]})
    problems: list[str] = []
    check_policy_room(policy, HW, problems, user_optimizer=False)
    assert len(problems) == 1 and "the policy leaves no attention" in problems[0], problems
    with pytest.raises(InputError, match="leaves no attention"):
        memopt.plan("tiny_gpt2", budget="4GB", hardware=HW, forbid={"attention": ["auto", "flash", "efficient",
                                                                                   "cudnn", "math"]})


def test_a_sharded_plan_never_runs_a_forbidden_attention():
    # sharded plans run PyTorch's own attention: forbidding it leaves them nothing to plan
    with pytest.raises(ValueError, match="attention='auto', which forbid excludes"):
        memopt.plan("tiny_gpt2", {"batch_size": 2, "seq_len": 32}, budget="4GB", hardware=HW, world_size=2,
                    forbid={"attention": ["auto"]})


@pytest.mark.parametrize("pins", [{"checkpoint_blocks": 0}, {"checkpoint_blocks": 0, "checkpointing": "none"}])
def test_zero_checkpointed_blocks_is_no_checkpointing(pins):
    policy = Policy.build(pins=pins)
    cands = candidates(_ctx(policy), policy)
    assert cands and {s.checkpointing.mode for s in cands} == {"none"}


def test_zero_checkpointed_blocks_with_none_forbidden_is_refused():
    policy = Policy.build(pins={"checkpoint_blocks": 0}, forbid={"checkpointing": ["none"]})
    problems: list[str] = []
    check_policy_room(policy, HW, problems, user_optimizer=False)
    assert len(problems) == 1 and "leaves no checkpointing" in problems[0], problems


def test_zero_checkpointed_blocks_plans_without_checkpointing_not_offload():
    plan = memopt.plan("tiny_gpt2", {"batch_size": 2, "seq_len": 32}, budget="4GB", hardware=HW,
                       pins={"checkpoint_blocks": 0})
    assert plan.fits and plan.strategy.checkpointing.mode == "none"
    assert plan.strategy.extra("sharding") is None, plan.strategy.label()


def test_forbidding_every_micro_batch_size_is_refused_before_tracing():
    policy = Policy.build(forbid={"micro_batch_size": [1, 2]})
    problems: list[str] = []
    check_micro_batch_room(policy, 2, problems)
    assert len(problems) == 1 and "leaves no micro_batch_size for the batch of 2" in problems[0]
    problems.clear()
    check_micro_batch_room(policy, 4, problems)  # 4 is left
    assert problems == []
    with pytest.raises(InputError, match="leaves no micro_batch_size"):
        memopt.plan("tiny_gpt2", {"batch_size": 2, "seq_len": 32}, budget="4GB", hardware=HW,
                    forbid={"micro_batch_size": [1, 2]})


@pytest.mark.parametrize("fidelity", [5, [5], 1.5])
def test_a_fidelity_of_the_wrong_type_names_the_key(fidelity):
    with pytest.raises(ValueError, match="fidelity must be a preset"):
        Policy.build(fidelity=fidelity)
