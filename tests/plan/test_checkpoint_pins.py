"""Pinned checkpointing on a model memopt cannot checkpoint is named as such, not as a budget that nothing fits."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memopt
from memopt.errors import InputError


class NoBlocks(nn.Module):
    """A UNet-like model: every layer different, no stack of blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.down, self.up = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(torch.relu(self.down(x))).mean()


class ThreeBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x.mean()


@pytest.mark.parametrize("pins", [{"checkpointing": "full"}, {"checkpointing": "selective"},
                                  {"checkpointing": "full", "checkpoint_blocks": 1}])
def test_pinned_checkpointing_without_blocks_says_so(pins: dict) -> None:
    with pytest.raises(InputError, match=r"NoBlocks has no repeated blocks to checkpoint.*drop the pin"):
        memopt.make_plan(NoBlocks(), torch.randn(4, 3, 8, 8), budget="10GB", hardware="h100_80gb", pins=pins)


def test_more_pinned_blocks_than_the_stack_has_are_refused() -> None:
    with pytest.raises(InputError, match=r"checkpoint_blocks=5 is more than the 3 blocks.*use 1 to 3"):
        memopt.make_plan(ThreeBlocks(), torch.randn(4, 8), budget="10GB", hardware="h100_80gb",
                         pins={"checkpointing": "full", "checkpoint_blocks": 5})
    plan = memopt.make_plan(ThreeBlocks(), torch.randn(4, 8), budget="10GB", hardware="h100_80gb",
                            pins={"checkpointing": "full", "checkpoint_blocks": 2})
    assert plan.strategy.checkpointing.num_blocks == 2


def test_pinning_no_checkpointing_needs_no_blocks() -> None:
    plan = memopt.make_plan(NoBlocks(), torch.randn(4, 3, 8, 8), budget="10GB", hardware="h100_80gb",
                            pins={"checkpointing": "none"})
    assert plan.fits and plan.strategy.checkpointing.mode == "none"
