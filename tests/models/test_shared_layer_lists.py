"""One layer listed several times in a ModuleList (``nn.ModuleList([layer] * n)``: one set of weights applied n
times) is not a stack of blocks: the estimate is that of a model without blocks (it crashed with an IndexError),
and checkpointing is refused with why, where distinct blocks of the same shape stay a stack."""

import pytest
import torch

import memopt
from memopt.blocks import find_block_stacks
from memopt.errors import InputError
from memopt.profile.cuda_semantics import kernel_policy_for
from memopt.profile.simulate import simulate_step
from memopt.strategy import Strategy
from tests.zoo.torch_patterns import Block, ResidualMLP, SharedLayer

HW = memopt.load_hardware("h200")
BATCH = {"x": torch.randn(8, 16), "labels": torch.randint(0, 4, (8,))}


def test_a_listed_module_is_not_a_stack_but_distinct_blocks_are():
    assert find_block_stacks(SharedLayer()) == []
    assert [len(s) for s in find_block_stacks(ResidualMLP())] == [4]
    mixed = torch.nn.ModuleList([Block(), Block()])
    mixed.append(mixed[0])  # two blocks and a repeat of the first
    assert find_block_stacks(torch.nn.Sequential(mixed)) == []


@pytest.mark.parametrize("applications", [2, 6])
def test_the_estimate_equals_the_simulated_step(applications):
    model = SharedLayer(applications)
    prof = memopt.profile(model, BATCH, hardware=HW, use_cache=False)
    s = Strategy(precision="fp32", micro_batch_size=4, grad_accum_steps=2)
    est = memopt.estimate(prof, s, num_steps=3)
    sim = simulate_step(model, lambda d: prof._batch_factory(8, d), s, policy=kernel_policy_for(HW), num_steps=3)
    assert est.peak_allocated_bytes == pytest.approx(sim.peak_allocated_bytes, rel=0.01)


def test_checkpointing_pinned_is_refused_with_the_reason():
    with pytest.raises(InputError, match="one module listed n times shares its weights"):
        memopt.plan(SharedLayer(), BATCH, budget="8GB", hardware=HW, use_cache=False,
                    pins={"checkpointing": "full"})
    plan = memopt.plan(SharedLayer(), BATCH, budget="8GB", hardware=HW, use_cache=False)
    assert plan.fits and plan.strategy.checkpointing.mode == "none"
