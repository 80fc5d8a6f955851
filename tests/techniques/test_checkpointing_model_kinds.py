"""Checkpointing on blocks whose form is not the usual one: layers whose weights torch's ``parametrize`` computes
(each such layer gets a class of its own), and blocks that write into a matmul's output in place, which selective
checkpointing cannot recompute exactly: it is refused for them with the reason, full checkpointing trains."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memopt
from memopt.blocks import find_block_stacks
from tests.zoo.torch_patterns import PATTERNS

_PAT = {p.name: p for p in PATTERNS}


def test_parametrized_layers_of_one_class_are_one_stack() -> None:
    model = _PAT["parametrized_blocks"].build()
    assert len({type(b) for b in model.blocks}) == 4  # what parametrize does: a fresh class per layer
    (stack,) = find_block_stacks(model)
    assert stack.path == "blocks" and len(stack) == 4 and stack.block_class == "Linear" and stack.uniform_tail
    # a parametrized layer beside a plain one of the same class: one kind of block, not interchangeable
    mixed = nn.ModuleList([nn.utils.parametrizations.weight_norm(nn.Linear(4, 4)), nn.Linear(4, 4), nn.Linear(4, 4)])
    (stack,) = find_block_stacks(nn.Sequential(mixed))
    assert len(stack) == 3


def test_a_parametrized_stack_is_checkpointed_exactly() -> None:
    pat = _PAT["parametrized_blocks"]
    g = torch.Generator().manual_seed(2)
    batches = [pat.sample(4, g) for _ in range(3)]

    def run(pins: dict) -> list[float]:
        torch.manual_seed(3)
        w = memopt.wrap(pat.build(), budget="10GB", sample=batches[0], hardware="h200", optimizer="sgd", lr=0.05,
                        guard=False, autotune=False, pins={"precision": "fp32", "micro_batch_size": 4, **pins})
        return [w.step({k: v.clone() for k, v in b.items()}) for b in batches]

    assert run({"checkpointing": "full"}) == pytest.approx(run({"checkpointing": "none"}), rel=1e-6)


def test_selective_is_refused_where_blocks_write_a_matmul_output_in_place() -> None:
    pat = _PAT["inplace_activations"]
    pinned = memopt.plan(pat.build(), pat.sample(4), budget="10GB", hardware="h200",
                         pins={"checkpointing": "selective"})
    said = [n for n in pinned.notes if "cannot be estimated" in n]
    assert len(said) == 1 and "selective checkpointing is refused for this model" in said[0]
    assert "ac=selective" in said[0] and "ac=full" not in said[0]
    assert not pinned.fits and pinned.infeasible["smallest_total_bytes"] is None
    assert pinned.infeasible["message"].startswith("no candidate could be estimated: the model's step fails")
    assert "more GPUs" not in pinned.infeasible["message"]  # not a memory problem
    with pytest.raises(ValueError, match=r"^no strategy can be planned: .*nn.ReLU\(inplace=True\)"):
        memopt.wrap(pat.build(), budget="10GB", sample=pat.sample(4), hardware="h200", guard=False, autotune=False,
                    pins={"checkpointing": "selective"})


def _tiny_llama(own_checkpointing: bool) -> nn.Module:
    from memopt.models import build_model

    torch.manual_seed(0)
    model = build_model("tiny_llama", device="cpu")
    if own_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers 5 renames gradient_checkpointing_enable
def test_a_model_that_checkpoints_itself_is_planned_and_trained_as_the_plan_says() -> None:
    """``model.gradient_checkpointing_enable()`` before ``wrap``: without memopt turning it off, every block would
    recompute whatever the plan says, and the plan would price a model it is not (its "no checkpointing" traced
    with Hugging Face's recomputation inside)."""
    sample = {"input_ids": torch.randint(0, 100, (4, 32)), "labels": torch.randint(0, 100, (4, 32))}
    pins = {"checkpointing": "none", "precision": "fp32"}
    plans = [memopt.plan(_tiny_llama(own), sample, budget="10GB", hardware="h200", use_cache=False, pins=pins)
             for own in (False, True)]
    assert plans[1].prediction["peak_allocated_bytes"] == plans[0].prediction["peak_allocated_bytes"]
    assert plans[1].step_time_s == pytest.approx(plans[0].step_time_s)
    model = _tiny_llama(True)
    w = memopt.wrap(model, budget="10GB", sample=sample, hardware="h200", guard=False, autotune=False, pins=pins,
                    optimizer="sgd", lr=0.05)
    assert not model.is_gradient_checkpointing
    got = w.step(sample)
    w.unwrap()
    assert model.is_gradient_checkpointing  # the user's setting, back
    ref = _tiny_llama(False)
    w_ref = memopt.wrap(ref, budget="10GB", sample=sample, hardware="h200", guard=False, autotune=False, pins=pins,
                        optimizer="sgd", lr=0.05)
    assert got == pytest.approx(w_ref.step(sample), rel=1e-6)
