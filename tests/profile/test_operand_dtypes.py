"""The dtype checks of the GPU's kernels, which the fake kernels of a trace skip: a variant whose step the GPU would
refuse fails its trace, so a pinned precision is refused with the reason and an unpinned plan picks another, where
the plan used to be made and the first step raised a raw torch error. What CUDA's kernels accept still plans."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt
from memopt.profile.operand_checks import check_operands
from tests.reference_loop import losses_of_plain_loop

KW = {"budget": "4GB", "hardware": "h100_80gb", "use_cache": False}
aten = torch.ops.aten


class AutocastTrunk(nn.Module):
    """Runs its blocks under its own bf16 autocast and its head in fp32 (``norm(h.float())``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16), nn.GELU()) for _ in range(2))
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            h = self.inp(x)
            for block in self.blocks:
                h = h + block(h)
        return self.head(self.norm(h.float()))


def _model() -> AutocastTrunk:
    torch.manual_seed(0)
    return AutocastTrunk()


def _batches(n: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(n)]


def _ce(out: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(out, batch[1])


def _wrap(model: nn.Module, sample: tuple, **kw: object) -> memopt.Wrapped:
    return memopt.wrap(model, sample=sample, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=_ce,
                       device="cpu", **KW, **kw)


def test_an_fp32_head_fed_to_bf16_weights_refuses_the_pinned_precision_and_plans_another():
    batches = _batches()
    bf16 = _model().bfloat16()
    with pytest.raises(RuntimeError):  # the real kernel refuses it (the CPU one with its own words)
        bf16(batches[0][0].bfloat16())
    with pytest.raises(ValueError, match=r"native_layer_norm.*torch.float32 input with torch.bfloat16 parameters"):
        _wrap(_model(), batches[0], fidelity="mixed", pins={"precision": "bf16_master"})

    model = _model()
    plan = memopt.plan(model, batches[0], loss_fn=_ce, fidelity="mixed", **KW)
    assert plan.strategy.precision not in ("bf16_master", "bf16_pure")
    assert any("torch.float32 input with torch.bfloat16 parameters" in note for note in plan.notes)

    # the plan it picks trains as the unwrapped loop does
    reference = _model()
    expected = losses_of_plain_loop(reference, batches, lambda m, b: _ce(m(b[0]), b),
                                    torch.optim.SGD(reference.parameters(), lr=0.1))
    w = _wrap(model, batches[0], fidelity="mixed")
    assert w.plan.strategy.precision not in ("bf16_master", "bf16_pure")
    assert [w.step(b) for b in batches] == pytest.approx(expected, abs=1e-6)


def test_a_model_already_in_fp16_refuses_a_bf16_weight_pin():
    """fp16 activations meet memopt's bf16 weights in every matmul: the GPU refuses it, and so does the plan."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).half()
    batch = (torch.randn(4, 8).half(), torch.randint(0, 4, (4,)))
    with pytest.raises(ValueError, match=r"addmm.*torch.float16 and torch.bfloat16"):
        _wrap(model, batch, fidelity="lossy", pins={"precision": "bf16_master"})


def _meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


@pytest.mark.parametrize(("x", "w"), [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                      (torch.float16, torch.bfloat16)])
def test_layer_and_group_norm_take_their_weights_in_the_input_dtype_as_cuda_does(x, w):
    """CUDA's layer_norm reads gamma and beta as the input's type: a bf16 input with fp32 weights, which the CPU
    kernel accepts, is refused on the GPU the plans are for."""
    with pytest.raises(RuntimeError, match="native_layer_norm"):
        check_operands(aten.native_layer_norm.default, (_meta(2, 6, dtype=x), [6], _meta(6, dtype=w), _meta(6, dtype=w),
                                                        1e-5))
    with pytest.raises(RuntimeError, match="native_group_norm"):
        check_operands(aten.native_group_norm.default, (_meta(2, 4, 3, dtype=x), _meta(4, dtype=w), None, 2, 4, 3, 2,
                                                        1e-5))
    check_operands(aten.native_layer_norm.default, (_meta(2, 6, dtype=x), [6], _meta(6, dtype=x), None, 1e-5))


def test_batch_norm_takes_fp32_parameters_for_a_16_bit_input_as_cuda_does():
    stats = (_meta(4), _meta(4), True, 0.1, 1e-5)
    for x in (torch.bfloat16, torch.float16, torch.float32):
        check_operands(aten.native_batch_norm.default, (_meta(2, 4, 3, dtype=x), _meta(4), _meta(4), *stats))
    with pytest.raises(RuntimeError, match="native_batch_norm"):
        check_operands(aten.native_batch_norm.default,
                       (_meta(2, 4, 3), _meta(4, dtype=torch.bfloat16), _meta(4, dtype=torch.bfloat16), *stats))


def test_a_conv_net_with_fp32_batch_norms_plans_under_bf16_autocast():
    """Autocast runs the convolutions in bf16 and leaves the batch norm's fp32 weights: CUDA's mixed kernel."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.LazyLinear(4))
    batch = (torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,)))
    model(batch[0])
    plan = memopt.plan(model, batch, loss_fn=_ce, pins={"precision": "bf16_autocast"}, **KW)
    assert plan.fits and plan.strategy.precision == "bf16_autocast"
