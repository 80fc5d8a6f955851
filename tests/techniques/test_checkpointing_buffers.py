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
