"""Adapters and quantized weights in the planner: only under their allowances, only as far down the fidelity
ladder (full fine-tuning, LoRA, LoRA on an 8-bit base, LoRA on a 4-bit base) as the budget forces, said plainly."""

import dataclasses

import pytest

import memopt
from memopt.hardware import load_hardware
from memopt.models import with_overrides
from memopt.plan import Policy
from memopt.plan.context import search_context
from memopt.plan.footprint import min_footprint
from memopt.plan.search import extras_levels

# wide and shallow: the weights and their optimizer states dominate, so every rung of the ladder saves memory
SPEC = with_overrides("tiny_llama", {"hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 8,
                                     "num_key_value_heads": 8})
SAMPLE = {"batch_size": 2, "seq_len": 16}
HW = dataclasses.replace(load_hardware("h200"), runtime_overhead_bytes=0)


@pytest.fixture(scope="module")
def prof():
    return memopt.profile(SPEC, sample=SAMPLE, hardware=HW, use_cache=False)


# techniques that matter little on this weight-dominated model stay fixed: fewer variants to trace
FIXED = {"activation_offload": False, "chunked_ce": 0, "checkpointing": "none", "expandable_segments": True}


def _plan(prof, budget: int, fidelity: str, **pins):
    return memopt.plan(SPEC, SAMPLE, budget=budget, hardware=HW, profile=prof,
                       policy=Policy.build(fidelity=fidelity, margin="0%", pins={**FIXED, **pins}))


def _smallest(prof, fidelity: str) -> int:
    """The policy's smallest estimated total (a budget of 1 byte would report only its model-state floor)."""
    pol = Policy.build(fidelity=fidelity, margin="0%", pins=FIXED)
    ctx = search_context(prof, HW, SAMPLE["batch_size"], pol, user_optimizer=False)
    ev = min_footprint(prof, HW, pol, ctx, 1 << 50)
    assert not ev.floor_only
    return ev.total_bytes


def _level(plan) -> tuple[int, int]:
    extras = plan.strategy.to_dict()["extras"]
    return (extras["adapters"]["r"] if "adapters" in extras else 0,
            extras["quantization"]["bits"] if "quantization" in extras else 0)


def test_the_ladder_goes_only_as_far_as_the_budget_forces(prof):
    full, lora, quant = _smallest(prof, "8bit"), _smallest(prof, "lora"), _smallest(prof, "qlora")
    assert full > lora > quant  # each rung saves memory on this model

    roomy = _plan(prof, 2 * full, "qlora")
    assert roomy.fits and _level(roomy) == (0, 0)  # full fine-tuning fits: the method stays
    assert not any("Training method changed" in n for n in roomy.notes)

    mid = _plan(prof, (full + lora) // 2, "qlora")
    assert mid.fits and _level(mid) == (16, 0)
    assert mid.total_bytes <= (full + lora) // 2
    assert any(n.startswith("Training method changed") and "full fine-tuning: needs" in n for n in mid.notes)
    assert "full fine-tuning" in mid.rejected["extras"]

    tight = _plan(prof, (lora + quant) // 2, "qlora")
    assert tight.fits and _level(tight)[1] in (4, 8) and _level(tight)[0] == 16
    assert "lora(r=16,alpha=32): needs" in tight.rejected["extras"]

    # without the allowances (and without offloading the states to the host) the same budget has no plan, and the
    # report says what allowing them would reach
    refused = _plan(prof, (full + lora) // 2, "8bit", offload=False)
    assert not refused.fits and _level(refused) == (0, 0)
    allow = {r["allow"]: r for r in refused.infeasible["relaxations"]}
    assert allow["adapters"]["fits"] and allow["adapters"]["reaches_bytes"] <= (full + lora) // 2
    # offload would keep full fine-tuning exact, but on this 34M-parameter model its engine's own memory outside
    # the allocator (NCCL and DeepSpeed: ~1 GB) is more than the states it moves: no plan either
    assert not _plan(prof, (full + lora) // 2, "8bit").fits


# wide and deeper: 0.67 B parameters whose states (8+ GB) dwarf the offload engine's fixed memory
WIDE = with_overrides("tiny_llama", {"num_hidden_layers": 8, "hidden_size": 2048, "intermediate_size": 8192,
                                     "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 32000})


def test_offload_is_the_plan_where_the_gpu_alone_has_none():
    from memopt.plan.sharded import plan_sharded

    prof = memopt.profile(WIDE, sample=SAMPLE, hardware=HW, use_cache=False)
    full = _smallest(prof, "8bit")
    _, cands = plan_sharded(prof, HW, 1 << 50, Policy.build(fidelity="8bit", margin="0%", pins=FIXED),
                            world_size=1, nodes=1, host_memory_bytes=1 << 40)
    offload_min = min(c.total_bytes for c in cands)
    assert 2 * offload_min < full  # the fixed cost (NCCL, DeepSpeed) is small next to these states
    budget = offload_min + (full - offload_min) // 8
    refused = _plan(prof, budget, "8bit", offload=False)
    assert not refused.fits
    # offload keeps full fine-tuning exact: allowed (the default), it is the plan where the GPU alone has none
    offloaded = _plan(prof, budget, "8bit")
    assert offloaded.fits and _level(offloaded) == (0, 0)
    assert offloaded.strategy.extra("sharding")["offload_optimizer"] != "none"
    assert offloaded.total_bytes <= budget
    assert any("offloaded to the host" in n for n in offloaded.notes)


def test_pins_choose_the_rung(prof):
    plan = _plan(prof, 10**12, "qlora", quant_bits=4, adapter_rank=8)
    assert _level(plan) == (8, 4)
    assert "Chosen by the pins" in " ".join(plan.notes)
    ctx = search_context(prof, HW, 2, Policy.build(fidelity="qlora"), user_optimizer=False)
    names = [[k for k, _ in lv] for lv in extras_levels(ctx, Policy.build(fidelity="qlora"))]
    assert names == [[], ["adapters"], ["adapters", "quantization"], ["adapters", "quantization"]]
    bits = [dict(dict(lv).get("quantization", {})).get("bits") for lv in
            extras_levels(ctx, Policy.build(fidelity="qlora", forbid={"quant_bits": 8}))]
    assert bits == [None, None, 4]
    assert extras_levels(ctx, Policy.build(fidelity="qlora", pins={"adapter_rank": 0})) == [()]
    assert extras_levels(ctx, Policy.build(fidelity="8bit")) == [()]  # not allowed: never offered


def test_policy_errors_name_the_fix():
    with pytest.raises(ValueError, match="'quantized_weights' needs 'adapters' too"):
        Policy.build(fidelity=["exact", "quantized_weights"])
    with pytest.raises(ValueError, match="needs fidelity allowance 'adapters'"):
        Policy.build(pins={"adapter_rank": 16})
    with pytest.raises(ValueError, match="quant_bits and adapter_rank=0 contradict"):
        Policy.build(fidelity="qlora", pins={"adapter_rank": 0, "quant_bits": 4})
    with pytest.raises(ValueError, match="valid values are 0, 4, 8"):
        Policy.build(fidelity="qlora", pins={"quant_bits": 3})
