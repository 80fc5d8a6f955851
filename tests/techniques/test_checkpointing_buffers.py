"""Checkpointing recomputes a block in backward: buffers that its forward updates (BatchNorm's running
statistics, a running mean kept by hand) must be updated once per step, as without checkpointing."""

import pytest
import torch
from torch import nn

from memopt.step.prepare import prepare
from memopt.strategy import Checkpointing, Strategy


class Running(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("seen", torch.zeros(8))
        self.register_buffer("mask", torch.ones(8), persistent=False)

    def forward(self, x):
        with torch.no_grad():
            self.seen.add_(x.mean(0))
        return torch.relu(self.lin(x)) * self.mask


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), Running()) for _ in range(3))

    def forward(self, x, labels):
        for b in self.blocks:
            x = b(x)
        return {"loss": nn.functional.mse_loss(x, labels)}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_buffers_are_updated_once_per_step_under_checkpointing(mode):
    torch.manual_seed(0)
    plain, ckpt = Net(), Net()
    ckpt.load_state_dict(plain.state_dict())
    batch = {"x": torch.randn(16, 8), "labels": torch.randn(16, 8)}
    steps = []
    for model, setting in ((plain, Checkpointing()), (ckpt, Checkpointing(mode=mode))):
        prepared = prepare(model, Strategy(precision="fp32", optimizer="sgd", checkpointing=setting,
                                           micro_batch_size=16), device_type="cpu")
        steps.append([prepared.step.step(batch) for _ in range(3)])
        prepared.undo()
    assert steps[0] == pytest.approx(steps[1], rel=1e-6)
    for (name, a), (_, b) in zip(plain.state_dict().items(), ckpt.state_dict().items()):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{name}: {m}")


class SpectralNet(nn.Module):
    """Blocks whose forward reads the state it updates: a spectral norm's power iteration starts from the vectors
    the last forward left (``torch.nn.utils.spectral_norm``'s hook, or the parametrization)."""

    def __init__(self, parametrization: bool) -> None:
        super().__init__()
        norm = nn.utils.parametrizations.spectral_norm if parametrization else nn.utils.spectral_norm
        self.blocks = nn.ModuleList(norm(nn.Linear(64, 64)) for _ in range(3))  # wide: one more iteration shows

    def forward(self, x, labels):
        for b in self.blocks:
            x = x + torch.tanh(b(x))
        return {"loss": nn.functional.mse_loss(x, labels)}


@pytest.mark.parametrize("parametrization", [False, True], ids=["hook", "parametrization"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_block_that_reads_the_state_it_writes_recomputes_from_the_state_its_forward_saw(mode, parametrization):
    """The recomputation starts from the buffers as the forward found them (it recomputed from the updated vectors:
    another weight, another gradient), and leaves them as the forward left them."""
    torch.manual_seed(0)
    plain, ckpt = SpectralNet(parametrization), SpectralNet(parametrization)
    ckpt.load_state_dict(plain.state_dict())
    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(16, 64, generator=g), "labels": torch.randn(16, 64, generator=g)} for _ in range(3)]
    steps = []
    for model, setting in ((plain, Checkpointing()), (ckpt, Checkpointing(mode=mode))):
        # large steps: the weights move away from the vectors' last iteration, which one more iteration then shows
        prepared = prepare(model, Strategy(precision="fp32", optimizer="sgd", checkpointing=setting,
                                           micro_batch_size=16), device_type="cpu", optimizer_kwargs={"lr": 1.0})
        steps.append([prepared.step.step(b) for b in batches])
        prepared.undo()
    assert steps[0] == pytest.approx(steps[1], rel=1e-6)
    for (name, a), (_, b) in zip(plain.state_dict().items(), ckpt.state_dict().items()):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{name}: {m}")


def test_selective_checkpointing_keeps_the_profiles_emulated_attention_kernels():
    """The profile traces CUDA's attention as its own custom ops: selective checkpointing must keep their outputs, or
    the trace would recompute attention where the GPU run keeps it."""
    import inspect
    import re

    from memopt.profile import attention_kernels
    from memopt.techniques.checkpointing import SELECTIVE_SAVE_OPS

    forward_ops = re.findall(r'custom_op\("memopt::(\w+_attention)"', inspect.getsource(attention_kernels))
    assert len(forward_ops) >= 3, forward_ops
    assert set(forward_ops) <= SELECTIVE_SAVE_OPS
