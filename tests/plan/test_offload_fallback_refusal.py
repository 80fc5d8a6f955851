"""When nothing fits on one GPU, the planner tries offloading the model states; a model that cannot run the way the
offload engine runs it (bf16 weights, no autocast) gets that refusal as a note, not a crash of the whole plan."""

import torch
from torch import nn

import memopt


class ConvNet(nn.Module):
    """Float images in: under bf16 weights without autocast the first convolution meets an fp32 input."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3)
        self.norm = nn.BatchNorm2d(16)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.head(self.norm(self.conv(x)).mean((2, 3))), y)


def test_a_budget_nothing_fits_reports_why_offload_cannot_help():
    batch = {"x": torch.randn(4, 3, 32, 32), "y": torch.randint(0, 10, (4,))}
    plan = memopt.plan(ConvNet(), batch, budget="1GB", hardware="h200", use_cache=False)
    assert not plan.fits
    assert "needs at least" in plan.infeasible["message"]
    refusal = [n for n in plan.notes if n.startswith("offloading the model states to the host was not possible")]
    assert len(refusal) == 1 and "Input type (float) and bias type (c10::BFloat16)" in refusal[0]


