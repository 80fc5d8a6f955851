"""The extras ladder as the registry's leveled techniques compose it (adapters, quantization): which levels each
policy, pin, forbid and installed package leaves, in order, written out by hand."""

import pytest

from memopt.plan.policy import Policy
from memopt.plan.search import extras_levels
from memopt.strategy import Strategy
from memopt.techniques.extras import extras_ladder
from memopt.techniques.protocol import SearchContext
from memopt.techniques.registry import BY_NAME, LEVELED, extras_saving


def _ctx(*, bnb: bool = True, peft: bool = True) -> SearchContext:
    return SearchContext(global_batch=4, block_counts=(2,), supports_bf16=True, causal_lm=True, vocab_size=1000,
                         bnb_available=bnb, flash_attn_available=False, user_optimizer=False, peft_available=peft)


def _short(levels) -> list[tuple[int, int]]:
    """(adapter rank, quantized bits) of each level, 0 where absent."""
    return [(dict(dict(lv).get("adapters", {"r": 0}))["r"], dict(dict(lv).get("quantization", {"bits": 0}))["bits"])
            for lv in levels]


def _levels(fidelity="default", *, bnb=True, peft=True, **policy) -> list[tuple[int, int]]:
    levels = extras_ladder(_ctx(bnb=bnb, peft=peft), Policy.build(fidelity=fidelity, **policy))
    assert levels == extras_levels(_ctx(bnb=bnb, peft=peft), Policy.build(fidelity=fidelity, **policy))
    return _short(levels)


def test_the_leveled_techniques_are_registered():
    assert [t.name for t in LEVELED] == ["adapters", "quantization"]
    assert all(BY_NAME[t.name] is t for t in LEVELED)
    assert [(t.pin, t.under, t.needs) for t in LEVELED] == [("adapter_rank", None, "adapters"),
                                                            ("quant_bits", "adapters", "quantized_weights")]


def test_ladders_by_policy():
    assert _levels("exact") == [(0, 0)]
    assert _levels("8bit") == [(0, 0)]  # full fine-tuning only
    assert _levels("lora") == [(0, 0), (16, 0)]
    assert _levels("qlora") == [(0, 0), (16, 0), (16, 8), (16, 4)]
    assert _levels("qlora", bnb=False) == [(0, 0), (16, 0)]  # no bitsandbytes: no quantized base
    assert _levels("qlora", peft=False) == [(0, 0)]  # no adapters: nothing to put a quantized base under
    assert _levels("lora", bnb=False, peft=False) == [(0, 0)]


def test_ladders_by_pin_and_forbid():
    assert _levels("qlora", pins={"adapter_rank": 8}) == [(8, 0), (8, 8), (8, 4)]
    assert _levels("lora", pins={"adapter_rank": 64}) == [(64, 0)]
    assert _levels("qlora", pins={"adapter_rank": 0}) == [(0, 0)]
    assert _levels("qlora", pins={"quant_bits": 4}) == [(16, 4)]
    assert _levels("qlora", pins={"quant_bits": 8, "adapter_rank": 32}) == [(32, 8)]
    assert _levels("qlora", pins={"quant_bits": 0}) == [(0, 0), (16, 0)]
    assert _levels("qlora", forbid={"quant_bits": 8}) == [(0, 0), (16, 0), (16, 4)]
    assert _levels("qlora", forbid={"quant_bits": [4, 8]}) == [(0, 0), (16, 0)]
    assert _levels("qlora", forbid={"adapter_rank": 16}) == [(0, 0)]
    assert _levels("qlora", forbid={"adapter_rank": 0}) == [(16, 0), (16, 8), (16, 4)]


def test_levels_hold_the_settings_the_plan_applies():
    levels = extras_ladder(_ctx(), Policy.build(fidelity="qlora"))
    assert levels[0] == ()
    assert [[k for k, _ in lv] for lv in levels] == [[], ["adapters"], ["adapters", "quantization"],
                                                     ["adapters", "quantization"]]
    assert dict(levels[1])["adapters"] == {"kind": "lora", "r": 16, "alpha": 32, "dropout": 0.0, "targets": None}
    assert dict(levels[3])["quantization"] == {"bits": 4, "double_quant": True, "quant_type": "nf4",
                                               "compute_dtype": "bf16", "blocksize": 64}
    assert [extras_saving(Strategy(extras=lv)) for lv in levels] == [0, 1, 2, 3]


def test_pins_that_leave_nothing_name_what_is_missing():
    with pytest.raises(ValueError, match=r"^the pins adapter_rank=None, quant_bits=4 leave nothing to plan: "
                                         r"bitsandbytes not installed \(pip install 'memopt\[bnb\]' peft\)$"):
        extras_ladder(_ctx(bnb=False), Policy.build(fidelity="qlora", pins={"quant_bits": 4}))
    with pytest.raises(ValueError, match=r"^the pins adapter_rank=16, quant_bits=None leave nothing to plan: "
                                         r"peft and bitsandbytes not installed"):
        extras_ladder(_ctx(bnb=False, peft=False), Policy.build(fidelity="lora", pins={"adapter_rank": 16}))
    with pytest.raises(ValueError, match=r"^the pins adapter_rank=None, quant_bits=None leave nothing to plan$"):
        extras_ladder(_ctx(), Policy.build(fidelity="qlora", forbid={"adapter_rank": [0, 16]}))
