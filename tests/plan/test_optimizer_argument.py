"""memopt.plan's optimizer= as memopt.wrap takes it: a variant's name is pinned (under the fidelity's rules), 'adamw'
leaves the planner the AdamW variant; and a forbidden optimizer is not brought back by an offload plan."""

from __future__ import annotations

import pytest

import memopt
from memopt.errors import InputError

SAMPLE = {"batch_size": 2, "seq_len": 64}


def test_a_named_optimizer_is_planned_not_replaced_by_adamw():
    plan = memopt.plan("tiny_llama", SAMPLE, budget="8GB", hardware="h100_80gb", optimizer="sgd")
    assert plan.strategy.optimizer == "sgd"
    chosen = memopt.plan("tiny_llama", SAMPLE, budget="8GB", hardware="h100_80gb", optimizer="adamw")
    assert chosen.strategy.optimizer.startswith("adamw")
    # the optimizer's states are in the estimate: SGD's one momentum buffer against AdamW's two moments (and steps)
    sgd, adamw = (p.prediction["breakdown"]["optimizer_states"] for p in (plan, chosen))
    assert 2 * sgd == pytest.approx(adamw, rel=0.02) and 2 * sgd < adamw


def test_a_named_optimizer_the_fidelity_does_not_allow_is_refused_with_the_fidelity_that_would():
    with pytest.raises(InputError, match=r"optimizer='adamw8bit' needs fidelity allowance '8bit_optimizer'"):
        memopt.plan("tiny_llama", SAMPLE, budget="8GB", hardware="h100_80gb", optimizer="adamw8bit")


def test_forbidding_the_only_adamw_the_fidelity_allows_is_refused_before_tracing():
    # llama3_8b at 8 x 4096 does not fit 80 GB without offloading its states
    sample = {"batch_size": 8, "seq_len": 4096}
    free = memopt.plan("llama3_8b", sample, budget="80GB", hardware="h100_80gb", host_memory="2TiB")
    assert free.fits and free.strategy.extra("sharding") is not None
    # the exact fidelity allows one optimizer, which the engines run too: nothing is left, on one GPU or sharded
    with pytest.raises(InputError, match=r"leaves no optimizer to plan on h100_80gb: .* forbids adamw_fused.*"
                                         r"adamw8bit, paged_adamw8bit need '8bit_optimizer'"):
        memopt.plan("llama3_8b", sample, budget="80GB", hardware="h100_80gb", host_memory="2TiB",
                    forbid={"optimizer": ["adamw_fused"]})
