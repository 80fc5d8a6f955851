"""A model trains in the dtypes it has: memopt casts floating weights only under bf16_pure and bf16_master. An fp64
model (scientific codes) keeps 8-byte weights, gradients and optimizer states under the other settings, and a model
loaded in bf16 (norms kept in fp32) 2-byte ones: the estimate, the state floor and the trained loop all agree."""

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import memopt
from memopt.plan.floors import state_floor
from memopt.profile.cuda_semantics import kernel_policy_for
from memopt.profile.simulate import simulate_step
from memopt.strategy import Checkpointing, Strategy

HW = memopt.load_hardware("h200")
BATCH = 8


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a norm kept in another dtype than the activations takes them in its own, as CUDA's layer_norm requires
        h = self.norm(x.to(self.norm.weight.dtype)).to(x.dtype)
        return x + self.down(F.gelu(self.up(h))).to(x.dtype)


class Net(nn.Module):
    def __init__(self, width: int = 128) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(3))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h).squeeze(-1)


def _loss(out, batch):
    return F.mse_loss(out.float(), batch[1].float())


def fp64_net() -> nn.Module:
    return Net().double()


def bf16_net() -> nn.Module:
    """Loaded in bf16 with its norms kept in fp32, as mixed checkpoints are (the norms cast what they are fed)."""
    model = Net().to(torch.bfloat16)
    for m in model.modules():
        if isinstance(m, nn.LayerNorm):
            m.float()
    return model


MODELS = {"fp64": (fp64_net, torch.float64, 8), "bf16": (bf16_net, torch.bfloat16, 2)}


def _batch(dtype):
    g = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, 16, 8, generator=g).to(dtype), torch.randn(BATCH, 16, generator=g).to(dtype)


@pytest.fixture(scope="module", params=sorted(MODELS))
def case(request):
    build, dtype, item = MODELS[request.param]
    torch.manual_seed(0)
    model = build()
    batch = _batch(dtype)
    prof = memopt.profile(model, batch, hardware=HW, loss_fn=_loss, use_cache=False)
    return model, batch, prof, item


@pytest.mark.parametrize("strategy", [
    Strategy(precision="fp32", micro_batch_size=4, grad_accum_steps=2),
    Strategy(precision="bf16_autocast", checkpointing=Checkpointing(mode="full"), micro_batch_size=4,
             grad_accum_steps=2),
    Strategy(precision="bf16_pure", micro_batch_size=8, grad_accum_steps=1),
], ids=lambda s: s.label())
def test_estimate_equals_the_simulated_step(case, strategy):
    model, _, prof, _ = case
    est = memopt.estimate(prof, strategy, num_steps=3)
    sim = simulate_step(model, lambda d: prof._batch_factory(BATCH, d), strategy, loss_fn=_loss,
                        policy=kernel_policy_for(HW), num_steps=3)
    assert est.peak_allocated_bytes == pytest.approx(sim.peak_allocated_bytes, rel=0.01)


def test_weights_are_counted_in_their_own_dtype(case):
    model, _, prof, item = case
    floats = [p for p in model.parameters() if p.dtype != torch.float32]
    own = sum(p.numel() * p.element_size() for p in model.parameters())
    assert floats and all(p.element_size() == item for p in floats)
    assert prof.param_bytes(torch.float32) == pytest.approx(own, rel=0.02)  # allocator rounding only
    # bf16_pure and bf16_master store every floating weight in bf16
    assert prof.param_bytes(torch.bfloat16) == pytest.approx(sum(p.numel() * 2 for p in model.parameters()), rel=0.02)


@pytest.mark.parametrize("optimizer", ["adamw_fused", "sgd", "adamw8bit"])
@pytest.mark.parametrize("precision", ["fp32", "bf16_autocast", "bf16_master"])
def test_the_state_floor_is_below_the_estimate(case, precision, optimizer):
    _, _, prof, item = case
    s = Strategy(precision=precision, optimizer=optimizer, checkpointing=Checkpointing(mode="full"),
                 micro_batch_size=BATCH, grad_accum_steps=1)
    if optimizer == "adamw8bit" and item == 8:  # 8-bit kernels step fp32/fp16/bf16 parameters only
        with pytest.raises(ValueError, match=r"optimizer 'adamw8bit' cannot train this model: .*float64"):
            memopt.estimate(prof, s)
        return
    est = memopt.estimate(prof, s)
    floor = state_floor(prof, s, HW)
    assert floor.total_bytes <= est.peak_allocated_bytes + est.runtime_bytes
    # not trivially low: the weights and gradients in the dtypes they train in (bf16_master: bf16 weights, fp32
    # gradients of the masters)
    params = list(case[0].parameters())
    own = sum(p.numel() * p.element_size() for p in params)
    expected = sum(p.numel() * 6 for p in params) if precision == "bf16_master" else 2 * own
    assert floor.weights_bytes + floor.gradients_bytes >= 0.95 * expected


def test_wrapped_steps_equal_the_unwrapped_loop_in_the_models_dtypes(case):
    model, batch, _, _ = case
    model, ref = copy.deepcopy(model), copy.deepcopy(model)
    dtypes = {p.dtype for p in model.parameters()}
    w = memopt.wrap(model, budget="8GB", sample=batch, hardware=HW, device="cpu", use_cache=False, loss_fn=_loss,
                    optimizer="sgd", lr=0.05, optimizer_kwargs={"momentum": 0.9}, pins={"precision": "fp32"},
                    autotune=False, guard=False)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for _ in range(2):
        got = w.step(batch)
        want = _loss(ref(batch[0]), batch)
        want.backward()
        opt.step()
        opt.zero_grad()
        assert float(got) == float(want.detach())
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert {p.dtype for p in model.parameters()} == dtypes


def test_eight_bit_states_refuse_fp64_parameters():
    """bitsandbytes' and torchao's kernels step fp32/fp16/bf16 parameters: refused for an fp64 model, with why."""
    batch = _batch(torch.float64)
    plan = memopt.plan(fp64_net(), batch, budget="8GB", hardware=HW, loss_fn=_loss, use_cache=False, fidelity="8bit")
    assert plan.fits and "8bit" not in plan.strategy.optimizer
    assert any(n.startswith("optimizer adamw8bit refused") and "float64" in n for n in plan.notes)
