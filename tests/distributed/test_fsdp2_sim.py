"""The FSDP2 memory estimate against PyTorch's FSDPMemTracker on fake tensors and a fake process group."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memopt.distributed import memory as mem
from memopt.distributed.sharding import mp_policy_for


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.a = nn.Linear(d, 4 * d, bias=False)
        self.b = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


class _Model(nn.Module):
    def __init__(self, d: int, n: int, v: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(v, d)
        self.layers = nn.ModuleList([_Block(d) for _ in range(n)])
        self.head = nn.Linear(d, v, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16_autocast", "fp32"])
def test_estimate_matches_fsdp_mem_tracker(precision):
    from memopt.distributed.simulate import simulate_fsdp2

    d, n, v, world = 512, 8, 256, 4
    sim = simulate_fsdp2(lambda: _Model(d, n, v), lambda: (torch.randint(0, v, (2, 16)),), world_size=world,
                         mp_policy=mp_policy_for(precision))
    unit, root = 2 * d * 4 * d, 2 * v * d
    m = mem.sharded_memory(n * unit + root, engine="fsdp2", stage=3, world_size=world,
                           sb=mem.state_bytes("fsdp2", precision), unit_params=[unit] * n, root_params=root)
    # measured: +0.6% (bf16 mixed precision), +1.1% (fp32)
    assert m.peak_bytes == pytest.approx(sim["states_peak"], rel=0.03)
    b = sim["states_breakdown"]
    assert m.params == b["Sharded Param"]
    assert m.optimizer == pytest.approx(b["OptState"], abs=1024)  # + AdamW's step scalars
