"""Arguments memopt.plan cannot plan as given: a budget beyond the device is planned for the device's memory (a plan
for memory the GPU lacks would not run on it); a pin the model cannot take exactly, and a hardware dict short of a
field, are refused in one line naming the fix."""

from __future__ import annotations

import dataclasses

import pytest
import transformers

import memopt
from memopt.errors import InputError
from memopt.plan.context import resolve_hardware

SAMPLE = {"batch_size": 2, "seq_len": 64}


def test_a_budget_beyond_the_device_is_planned_for_the_device():
    device = resolve_hardware("h100_80gb").memory_bytes
    plan = memopt.plan("tiny_llama", SAMPLE, budget="500GB", hardware="h100_80gb")
    assert plan.budget_bytes == device
    assert any(n.endswith(f"planned for the device's {memopt.units.format_bytes(device)}") for n in plan.notes)
    same = memopt.plan("tiny_llama", SAMPLE, budget=device, hardware="h100_80gb")
    assert (plan.strategy, plan.total_bytes) == (same.strategy, same.total_bytes)


def test_chunked_cross_entropy_pinned_on_a_head_with_a_bias_names_the_reason():
    config = transformers.GPTJConfig(n_embd=32, n_layer=2, n_head=4, vocab_size=128, n_positions=64, rotary_dim=4)
    model = transformers.GPTJForCausalLM(config)
    with pytest.raises(InputError, match=r"pin chunked_ce=4 cannot be honoured: chunked cross-entropy would not be "
                                         r"exact for this model \(GPTJForCausalLM's head has a bias\); drop the pin"):
        memopt.plan(model, SAMPLE, budget="8GB", hardware="h100_80gb", pins={"chunked_ce": 4})


def test_a_hardware_dict_missing_a_field_names_the_fields_it_needs():
    full = dataclasses.asdict(resolve_hardware("h100_80gb"))
    partial = {"name": "mygpu", "memory_bytes": 80 * 10**9}
    with pytest.raises(InputError, match=r"hardware dict lacks '\w+': give each of name, .*, or a shipped name"):
        memopt.plan("tiny_llama", SAMPLE, budget="8GB", hardware=partial)
    assert memopt.plan("tiny_llama", SAMPLE, budget="8GB", hardware=full).fits  # the complete dict plans
