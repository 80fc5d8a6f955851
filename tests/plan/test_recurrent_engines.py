"""cuDNN runs a recurrent layer on its weights as one contiguous chunk; DeepSpeed's flat buffers and FSDP2's gathered
shards break that chunk, and cuDNN then copies every weight at each call (a GRU LM's one-GPU ZeRO-2 offload plan
ran out of its cap on an H100 in its first backward). Those engines are refused for such models, with the reason;
DDP, which leaves the weights alone, is kept."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt
from memopt.hardware import load_hardware
from memopt.plan import Policy
from memopt.plan.sharded import plan_sharded


class GRULM(nn.Module):
    def __init__(self, vocab: int = 500, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.rnn = nn.GRU(width, width, num_layers=2, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(ids))[0])


@functools.cache
def _profile():
    sample = (torch.randint(0, 500, (8, 32)), torch.randint(0, 500, (8, 32)))
    return memopt.profile(GRULM(), sample, hardware="h100_80gb", use_cache=False,
                          loss_fn=lambda out, b: F.cross_entropy(out.flatten(0, 1), b[1].flatten()))


def test_the_profile_names_the_recurrent_layers():
    assert _profile().recurrent_layers == ["rnn"]


def test_one_gpu_offload_engines_are_refused_with_the_reason():
    hw = load_hardware("h100_80gb")
    with pytest.raises(ValueError, match=r"recurrent layers \(rnn\) would no longer hold their weights"):
        plan_sharded(_profile(), hw, 1 << 40, Policy.build(), world_size=1, nodes=1, host_memory_bytes=1 << 40)


def test_several_gpus_keep_ddp_and_say_why_the_others_went():
    hw = load_hardware("h100_80gb")
    plan, candidates = plan_sharded(_profile(), hw, 1 << 40, Policy.build(), world_size=2, nodes=1,
                                    host_memory_bytes=1 << 40)
    assert plan.fits and {c.setting.engine for c in candidates} == {"ddp"}
    assert any("DeepSpeed and FSDP2 refused" in n for n in plan.notes)


def test_a_budget_only_offload_could_meet_says_offload_was_refused_and_why():
    """Nothing fits one GPU alone, and the offload engines are refused: the plan's message says both."""
    sample = (torch.randint(0, 20000, (8, 32)), torch.randint(0, 20000, (8, 32)))
    # 11M parameters: 176 MB of fp32 weights, gradients and AdamW states, above what 950 MB leaves beside the runtime
    plan = memopt.plan(GRULM(20000, 256), sample, budget="950MB", hardware="h100_80gb", use_cache=False,
                       loss_fn=lambda out, b: F.cross_entropy(out.flatten(0, 1), b[1].flatten()))
    assert not plan.fits
    assert "offloading the model states to the host was not possible" in plan.infeasible["message"]
    assert "recurrent layers (rnn)" in plan.infeasible["message"]
