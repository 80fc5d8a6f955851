"""Model-state arithmetic that can be done by hand."""

import torch
from torch import nn

import memopt
from memopt.categories import MemoryCategory
from memopt.strategy import Strategy

WIDTH = 1024  # every tensor a multiple of 512 B, so the allocator's rounding adds nothing


class Stack(nn.Module):
    def __init__(self, n: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(n))

    def forward(self, x, labels):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return {"loss": nn.functional.mse_loss(x, labels)}


def _estimate(strategy: Strategy):
    sample = {"x": torch.randn(8, WIDTH), "labels": torch.randn(8, WIDTH)}
    prof = memopt.profile(Stack(), sample=sample, hardware="h100_80gb", use_cache=False)
    return prof, memopt.estimate(prof, strategy, exact_reserved=False)


def test_mixed_precision_adam_is_16_bytes_a_parameter():
    prof, est = _estimate(Strategy(precision="bf16_autocast", optimizer="adamw_fused", micro_batch_size=8))
    n = prof.num_params
    assert n == 6 * WIDTH * WIDTH
    b = est.breakdown
    assert b[MemoryCategory.PARAMETERS] == 4 * n  # fp32 weights
    # the peak is in the second step's backward: fp32 gradients (4 B) and Adam's two fp32 moments (8 B), plus a
    # 512 B step counter per parameter tensor (fused AdamW keeps it on the GPU)
    assert b[MemoryCategory.OPTIMIZER_STATES] == 8 * n + 6 * 512
    assert b.get(MemoryCategory.GRADIENTS, 0) <= 4 * n
    assert b[MemoryCategory.PARAMETERS] + b[MemoryCategory.OPTIMIZER_STATES] + 4 * n == 16 * n + 6 * 512


def test_eight_bit_adam_states():
    prof, est = _estimate(Strategy(precision="bf16_autocast", optimizer="adamw8bit", micro_batch_size=8))
    n = prof.num_params
    per_tensor = WIDTH * WIDTH
    blocks = per_tensor // 256
    # two uint8 states and one fp32 absmax per 256 values for each, plus two 256-entry fp32 code maps
    expected = 6 * (2 * per_tensor + 2 * blocks * 4) + 2 * 1024
    assert est.breakdown[MemoryCategory.OPTIMIZER_STATES] == expected
    assert expected < 2.1 * n


def test_bf16_master_and_pure():
    prof, master = _estimate(Strategy(precision="bf16_master", micro_batch_size=8))
    n = prof.num_params
    b = master.breakdown
    assert b[MemoryCategory.PARAMETERS] == 2 * n  # bf16 weights
    # the peak is the first optimizer step: fp32 masters (4 B) + the moments it creates (8 B) + step counters,
    # the bf16 gradients (2 B) and their fp32 copies for the masters (4 B)
    assert b[MemoryCategory.OPTIMIZER_STATES] == 12 * n + 6 * 512
    assert b[MemoryCategory.GRADIENTS] == 2 * n
    assert b[MemoryCategory.TEMPORARIES] >= 4 * n
    assert master.peak_at == "step 1, optimizer step"
    _, pure = _estimate(Strategy(precision="bf16_pure", micro_batch_size=8))
    assert pure.breakdown[MemoryCategory.OPTIMIZER_STATES] == 4 * n + 6 * 512  # bf16 moments
