"""The optimizer registry: each variant's byte model against what it allocates, its floor never above the truth, the
one list every other part of memopt reads, and torchao's low-bit AdamW planned when pinned."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import memopt
from memopt.config.validate import OPTIMIZER_CHOICES
from memopt.integrations.hf_trainer import TRAINER_OPTIM
from memopt.plan.checks import OPTIMIZER_NAMES as USER_NAMES
from memopt.plan.policy import PINNABLE, Policy, fidelity_of
from memopt.techniques.optimizers import OPTIMIZER_NAMES, VARIANTS, build_optimizer, variant
from memopt.units import allocator_size

# tensors below, at and above every threshold a byte model has: bitsandbytes' and torchao's 4096-value quantization
# floor, torchao's blocks (a size that is not a multiple of 128 or 256), bitsandbytes' 100,000-value paging floor
NUMELS = (100, 4095, 4096, 4096 + 64, 65_536, 100_000, 131_072)


def _params(numels=NUMELS) -> list[nn.Parameter]:
    return [nn.Parameter(torch.randn(n)) for n in numels]


def _state_bytes(opt: torch.optim.Optimizer, host: str | None = None) -> tuple[int, int]:
    """(device, elsewhere) bytes of the optimizer's state tensors, each rounded as the caching allocator rounds it
    (a tensor met twice, a shared quantization map, once)."""
    seen: set[int] = set()
    device = other = 0
    for state in opt.state.values():
        for t in state.values():
            if not isinstance(t, torch.Tensor) or id(t) in seen:
                continue
            seen.add(id(t))
            if host is not None and t.device.type == host:
                other += t.untyped_storage().nbytes()
            else:
                device += allocator_size(t.untyped_storage().nbytes())
    return device, other


@pytest.mark.parametrize("name", [n for n, v in VARIANTS.items() if v.trace_stand_in is None])
def test_the_byte_model_of_each_torch_variant_is_what_it_allocates(name):
    params = _params()
    opt = build_optimizer(name, params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    device = 0
    for state in opt.state.values():
        for t in state.values():
            if isinstance(t, torch.Tensor) and (t.dim() > 0 or name == "adamw_fused"):
                device += allocator_size(t.untyped_storage().nbytes())
    assert VARIANTS[name].state_bytes(NUMELS, torch.float32, True) == (device, 0)


@pytest.mark.parametrize("name", [n for n, v in VARIANTS.items() if v.trace_stand_in is not None])
def test_the_trace_stand_in_allocates_what_the_byte_model_says(name):
    params = _params()
    opt = VARIANTS[name].trace_optimizer(params, "meta")  # the paged variant's paged states go to the host device
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    device, paged = _state_bytes(opt, host="meta")
    assert VARIANTS[name].state_bytes(NUMELS, torch.float32, True) == (device, paged)


def test_torchao_low_bit_states_by_hand():
    """One 65,536-value tensor: two states of codes (1 or 1/2 byte a value), an fp32 scale per block (256 / 128
    values) and a quantization map (256 / 16 fp32) each; a 4,160-value tensor (not a multiple of the block) keeps two
    fp32 states; torchao's step count lives on the CPU."""
    r = allocator_size
    eight = VARIANTS["torchao_adamw8bit"].state_bytes
    four = VARIANTS["torchao_adamw4bit"].state_bytes
    assert eight([65_536], torch.float32, True) == (2 * (r(65_536) + r(256 * 4) + r(256 * 4)), 0)
    assert four([65_536], torch.float32, True) == (2 * (r(32_768) + r(512 * 4) + r(16 * 4)), 0)
    assert eight([4_160], torch.float32, True) == (2 * r(4_160 * 4), 0)
    assert four([4_160], torch.bfloat16, False) == (2 * 4_160 * 2, 0)


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("item", [2, 4])
def test_the_floor_never_exceeds_what_the_states_take(name, item):
    dtype = torch.bfloat16 if item == 2 else torch.float32
    device, paged = VARIANTS[name].state_bytes(NUMELS, dtype, True)
    assert 0 < VARIANTS[name].floor_bytes(list(NUMELS), item) <= device + paged


def test_every_part_of_memopt_reads_the_one_registry():
    assert PINNABLE["optimizer"] == OPTIMIZER_NAMES == (*VARIANTS, "user")
    assert ("auto", *VARIANTS) == OPTIMIZER_CHOICES
    assert set(VARIANTS) <= set(USER_NAMES)
    assert set(TRAINER_OPTIM) == {n for n, v in VARIANTS.items() if v.trainer_optim}
    assert {n: fidelity_of("optimizer", n) for n in VARIANTS} == {n: v.fidelity for n, v in VARIANTS.items()}
    assert fidelity_of("optimizer", "torchao_adamw4bit") == "lossy"


def test_an_unknown_optimizer_names_every_known_one():
    with pytest.raises(ValueError, match="torchao_adamw8bit") as err:
        variant("adamw_8bit")
    assert "adamw_fused" in str(err.value)


def test_a_missing_package_says_what_to_install(monkeypatch):
    absent = dataclasses.replace(VARIANTS["torchao_adamw8bit"], requires="memopt_no_such_package")
    monkeypatch.setitem(VARIANTS, "torchao_adamw8bit", absent)
    with pytest.raises(ValueError, match=r"needs memopt_no_such_package: pip install 'memopt\[torchao\]'"):
        build_optimizer("torchao_adamw8bit", _params((4096,)))


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
                                    for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x.square().mean()


@pytest.mark.parametrize(("name", "fidelity"), [("torchao_adamw8bit", "8bit"), ("torchao_adamw4bit", "lossy")])
def test_a_pinned_torchao_optimizer_is_planned_with_its_states(name, fidelity):
    """Planned without torchao installed (the trace steps its stand-in): the plan's optimizer states are what the
    byte model says for the model's parameters, well under AdamW's 8 bytes a parameter."""
    model = _Mlp()
    x = torch.randn(8, 256)
    pins = {"optimizer": name, "precision": "fp32", "checkpointing": "none", "micro_batch_size": 8}
    plan = memopt.plan(model, x, budget="8GB", hardware="h200", fidelity=fidelity, pins=pins, use_cache=False)
    assert plan.strategy.optimizer == name
    numels = [p.numel() for p in model.parameters()]
    device, _ = VARIANTS[name].state_bytes(numels, torch.float32, True)
    assert plan.prediction["breakdown"]["optimizer_states"] == device
    assert device < 0.3 * 8 * sum(numels)


def test_each_low_bit_optimizer_needs_its_fidelity():
    exact, eight_bit = Policy.build(fidelity="exact"), Policy.build(fidelity="8bit")
    assert exact.allows("optimizer", "adamw_fused") and not exact.allows("optimizer", "torchao_adamw8bit")
    assert eight_bit.allows("optimizer", "torchao_adamw8bit") and not eight_bit.allows("optimizer", "torchao_adamw4bit")
    assert Policy.build(fidelity="lossy").allows("optimizer", "torchao_adamw4bit")
