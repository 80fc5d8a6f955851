"""memopt.estimate refuses a strategy it cannot estimate in one line naming each bad field, before it composes
anything: a count of 0 (a step that trains no sample) or below (negative allocations) has no estimate."""

from __future__ import annotations

import pytest

import memopt
from memopt import Strategy
from memopt.strategy import Checkpointing


@pytest.fixture(scope="module")
def prof() -> memopt.Profile:
    return memopt.profile("tiny_gpt2", {"batch_size": 8, "seq_len": 32}, hardware="h100_80gb")


@pytest.mark.parametrize(("strategy", "named"), [
    (Strategy(micro_batch_size=8, grad_accum_steps=0), "Strategy.grad_accum_steps=0 must be an integer >= 1"),
    (Strategy(micro_batch_size=8, grad_accum_steps=-2), "Strategy.grad_accum_steps=-2 must be an integer >= 1"),
    (Strategy(micro_batch_size=0, grad_accum_steps=8), "Strategy.micro_batch_size=0 must be an integer >= 1"),
    (Strategy(micro_batch_size=-1, grad_accum_steps=8), "Strategy.micro_batch_size=-1 must be an integer >= 1"),
    (Strategy(micro_batch_size=8, chunked_ce=-1), "Strategy.chunked_ce=-1 must be an integer >= 0"),
    (Strategy(micro_batch_size=8, checkpointing=Checkpointing(mode="full", num_blocks=-1)),
     "Strategy.checkpointing.num_blocks=-1"),
])
def test_a_strategy_that_cannot_be_estimated_is_refused_naming_its_field(prof, strategy, named) -> None:
    with pytest.raises(memopt.InputError) as err:
        memopt.estimate(prof, strategy, hardware="h100_80gb")
    assert named in str(err.value) and "\n" not in str(err.value)


def test_every_problem_is_on_the_one_line(prof) -> None:
    with pytest.raises(memopt.InputError, match=r"^invalid strategy: Strategy.micro_batch_size=0 .*; "
                       r"Strategy.grad_accum_steps=0 .*; Strategy.precision='bf32' is not one of fp32"):
        memopt.estimate(prof, Strategy(micro_batch_size=0, grad_accum_steps=0, precision="bf32"))  # type: ignore[arg-type]
    assert memopt.estimate(prof, Strategy(micro_batch_size=4, grad_accum_steps=2)).total_bytes > 0


@pytest.mark.parametrize(("strategy", "total"), [(Strategy(precision="bf16_autocast"), 1),
                                                  (Strategy(micro_batch_size=16), 16),
                                                  (Strategy(micro_batch_size=3, grad_accum_steps=5), 15)])
def test_a_strategy_of_another_batch_than_the_profiles_is_refused(prof, strategy, total):
    """The profile is of 8 samples: a strategy of 1 (the defaults), 16 or 15 was estimated for that many, silently
    (the package docstring's own example reported the peak of one sample)."""
    split = r"micro_batch_size x grad_accum_steps = 8 \(8 x 1, 4 x 2, 2 x 4, 1 x 8\)"
    with pytest.raises(memopt.InputError, match=rf"= {total} samples per step, but the profile is of a batch of 8 .*"
                                                rf"{split}"):
        memopt.estimate(prof, strategy)
    assert memopt.estimate(prof, Strategy(micro_batch_size=2, grad_accum_steps=4)).items_per_step == 8 * 32


@pytest.mark.parametrize(("call", "message"), [
    (lambda p: memopt.estimate(p, Strategy(micro_batch_size=8, checkpointing="full")),  # type: ignore[arg-type]
     r"Strategy.checkpointing='full' must be a memopt.Checkpointing"),
    (lambda p: memopt.estimate(p, Strategy(micro_batch_size=8, optimizer="adam")),
     r"Strategy.optimizer='adam' is not one of adamw_fused"),
    (lambda p: memopt.estimate("tiny_gpt2", Strategy(micro_batch_size=8)), r"profile must be a memopt.Profile"),
    (lambda p: memopt.estimate(p, Strategy(micro_batch_size=8), hardware="h100"), r"unknown hardware 'h100'"),
    (lambda p: memopt.estimate(p, Strategy(micro_batch_size=8), hardware="t4"), r"traced for h100_80gb"),
])
def test_bad_input_to_estimate_is_an_input_error(prof, call, message):
    """An AttributeError ('str' object has no attribute 'mode') or a plain ValueError escaped before."""
    with pytest.raises(memopt.InputError, match=message):
        call(prof)
