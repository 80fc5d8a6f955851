"""A model whose own step fails under some variant is planned without it, with the reason, never a crash: an op
with no bf16 kernel (FNet's FFT, YOSO's fp32 kernels) leaves fp32 plans, and leaves the single-GPU verdict when
nothing fits on one GPU (the offload engines run bf16 weights). An fp32 input is no such failure: under bf16 weights
the model takes its inputs in bf16, as the engines and memopt's own bf16 weights give them."""

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


def test_float_inputs_meet_bf16_weights_in_bf16():
    batch = {"x": torch.randn(4, 3, 32, 32), "y": torch.randint(0, 10, (4,))}
    plan = memopt.plan(ConvNet(), batch, budget="1GB", hardware="h200", use_cache=False)
    assert not plan.fits
    assert "needs at least" in plan.infeasible["message"]
    assert not [n for n in plan.notes if n.startswith("offloading the model states to the host was not possible")]


class Fp32OnlyOp(nn.Module):
    """A block around a kernel that only exists in fp32 (as custom CUDA kernels often do)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.proj(h)
        if h.dtype != torch.float32:
            raise RuntimeError(f"expected scalar type torch.float32 but found {h.dtype}")
        return h.tanh()


class Fp32OnlyNet(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Fp32OnlyOp(width) for _ in range(3))
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.head(x), y)


def test_a_model_without_bf16_kernels_gets_an_fp32_plan_that_trains_exactly():
    g = torch.Generator().manual_seed(0)
    batch = {"x": torch.randn(8, 32, generator=g), "y": torch.randint(0, 5, (8,), generator=g)}
    plan = memopt.plan(Fp32OnlyNet(), batch, budget="8GB", hardware="h200", use_cache=False)
    assert plan.fits and plan.strategy.precision == "fp32"
    torch.manual_seed(0)
    model, ref = Fp32OnlyNet(), Fp32OnlyNet()
    ref.load_state_dict(model.state_dict())
    w = memopt.wrap(model, budget="8GB", sample=batch, hardware="h200", device="cpu", use_cache=False,
                    optimizer="sgd", lr=0.1, autotune=False, guard=False)
    assert w.plan.strategy.precision == "fp32"
    loss = w.step(batch)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    expected = ref(**batch)
    expected.backward()
    opt.step()
    assert abs(float(loss) - float(expected)) < 1e-6
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)


def test_a_budget_nothing_fits_reports_why_offload_cannot_help():
    g = torch.Generator().manual_seed(0)
    batch = {"x": torch.randn(8, 32, generator=g), "y": torch.randint(0, 5, (8,), generator=g)}
    plan = memopt.plan(Fp32OnlyNet(), batch, budget="1GB", hardware="h200", use_cache=False)
    assert not plan.fits
    assert "needs at least" in plan.infeasible["message"]
    refusal = [n for n in plan.notes if n.startswith("offloading the model states to the host was not possible")]
    assert len(refusal) == 1 and "expected scalar type torch.float32 but found torch.bfloat16" in refusal[0]
