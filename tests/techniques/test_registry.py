"""The registry answers for every technique: each has its place in the label, a title and a rendering for the dry
run, and a fidelity class; a strategy's label is its techniques' parts in the label order."""

from __future__ import annotations

from memopt.strategy import Checkpointing, Strategy
from memopt.techniques.quantization import qlora
from memopt.techniques.registry import BY_NAME, LABEL_ORDER, TECHNIQUES, strategy_label
from memopt.techniques.sharding import ShardingSetting


def test_every_technique_has_its_place_in_the_label():
    assert sorted(LABEL_ORDER) == sorted(BY_NAME)
    assert all(t.title for t in BY_NAME.values())


def test_the_label_joins_each_techniques_part_in_order():
    s = qlora(Strategy(activation_offload=True, attention="flash", chunked_ce=8, expandable_segments=False,
                       checkpointing=Checkpointing(mode="full", num_blocks=3), micro_batch_size=2, grad_accum_steps=4))
    s = s.replace(extras=(*s.extras, ("sharding", ShardingSetting(world_size=4).to_dict())))
    assert s.label() == strategy_label(s) == ("fp32 ac=full[3] mb=2x4 paged_adamw8bit act-offload attn=flash "
                                              "chunked-ce=8 default-alloc lora(r=16,alpha=32) nf4+dq fsdp2 x4")
    assert Strategy().label() == "fp32 ac=none mb=1x1 adamw_fused expandable"


def test_fidelity_and_rendering_come_from_the_technique():
    assert BY_NAME["optimizer"].fidelity("paged_adamw8bit") == "8bit_optimizer"
    assert BY_NAME["precision"].fidelity("bf16_pure") == "lossy"
    assert BY_NAME["adapters"].fidelity(0) == "exact" and BY_NAME["quantization"].fidelity(4) == "quantized_weights"
    rendered = {t.name: t.render(v, Strategy(micro_batch_size=2, grad_accum_steps=3).to_dict())
                for t, v in zip(TECHNIQUES, ("bf16_autocast", {"mode": "full", "num_blocks": None}, True, "auto", 8,
                                             "liger", "adamw_fused", 2, False), strict=True)}
    assert rendered == {"precision": "bf16_autocast", "checkpointing": "full, every block",
                        "activation_offload": "on", "attention": "auto", "chunked_ce": "8 chunks", "ce_kernel": "liger",
                        "optimizer": "adamw_fused", "micro_batch_size": "2 x 3 accumulation steps",
                        "expandable_segments": "off"}
