"""The planner chooses only GPU-validated optimizers by itself; the others are honoured when pinned."""

from memopt.models import with_overrides
from memopt.plan.planner import make_plan

SPEC = with_overrides("tiny_llama", {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
                                     "vocab_size": 1024})
SAMPLE = {"batch_size": 4, "seq_len": 64}


def test_unvalidated_optimizers_only_when_pinned():
    free = make_plan(SPEC, SAMPLE, budget="8GB", hardware="h100_80gb")
    assert free.strategy.optimizer == "adamw_fused"
    assert "adamw_foreach" not in (free.rejected or {}).get("optimizer", "")
    pinned = make_plan(SPEC, SAMPLE, budget="8GB", hardware="h100_80gb", pins={"optimizer": "adamw_foreach"})
    assert pinned.strategy.optimizer == "adamw_foreach" and pinned.fits
    # foreach keeps a temporary copy of the states in its step: never smaller than fused
    assert pinned.peak_allocated_bytes >= free.peak_allocated_bytes
