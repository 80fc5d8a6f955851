"""Recurrent layers traced as cuDNN's one fused kernel (``memopt.profile.recurrent_kernels``): a trace records one
call per layer stack whatever the sequence length (the CPU's own path unrolls every time step), allocates the
kernel's output, states, reserve space and weight gradients, and counts its time steps as serial GPU kernels.
Real tensors keep ATen's own path, values included."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import memopt
from memopt.profile.costs import CostRecorder
from memopt.profile.cuda_semantics import cuda_semantics, kernel_policy_for
from memopt.profile.recurrent_kernels import RecurrentShape, reserve_bytes
from memopt.profile.tracker import MemoryTracker
from memopt.units import allocator_size

POLICY = kernel_policy_for(memopt.load_hardware("h200"))


def _trace(module: nn.Module, batch: int, steps: int, *, autocast: bool = False) -> dict:
    """One forward and backward of ``module`` on fake tensors under the CUDA emulation: the bytes the forward
    leaves alive, the ops the tracker saw, and the costs."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        for name, p in list(module.named_parameters()):
            *path, leaf = name.split(".")
            owner = module.get_submodule(".".join(path))
            setattr(owner, leaf, nn.Parameter(fake.from_tensor(p.detach())))
        x = torch.empty(batch, steps, module.input_size, requires_grad=True)
        tracker = MemoryTracker("cpu")
        ops: list[str] = []
        costs = CostRecorder(lambda: 0)
        tracker.op_hooks.append(lambda func, args, out: ops.append(str(func)))
        tracker.op_hooks.append(costs)
        with cuda_semantics(POLICY, tracker), tracker, torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            before = tracker.current_bytes
            out, _ = module(x)
            saved = tracker.current_bytes - before
            out.float().sum().backward()
        grads = [p.grad for p in module.parameters()]
    return {"saved": saved, "ops": ops, "cost": costs.costs[0], "grads": grads, "out": out}


@pytest.mark.parametrize("cls", [nn.GRU, nn.LSTM, nn.RNN])
def test_one_call_per_layer_stack_whatever_the_length(cls):
    short = _trace(cls(32, 32, num_layers=2, batch_first=True), 4, 8)
    long = _trace(cls(32, 32, num_layers=2, batch_first=True), 4, 256)
    assert len(long["ops"]) == len(short["ops"])  # the CPU path records ~10 ops per step and layer
    assert sum("cudnn_rnn" in o for o in long["ops"]) == 2  # forward and backward
    assert long["cost"].library_kernels > 10 * short["cost"].library_kernels  # cuDNN's serial time steps


def test_forward_keeps_output_states_and_reserve():
    s = RecurrentShape("lstm", 48, 64, 0, 2, 2, 100, 8 * 100, 8, 4)
    got = _trace(nn.LSTM(48, 64, num_layers=2, batch_first=True, bidirectional=True), 8, 100)
    output = 8 * 100 * 2 * 64 * 4
    states = 4 * allocator_size(2 * 2 * 8 * 64 * 4)  # nn.LSTM's zero h0 and c0, the kernel's hy and cy
    assert got["saved"] == allocator_size(output) + states + allocator_size(reserve_bytes(s))
    assert tuple(got["out"].shape) == (8, 100, 128)
    assert not got["out"].is_contiguous()  # cuDNN writes time-major and returns the batch-first view


@pytest.mark.parametrize(("mode", "dtype_bytes", "hidden", "proj", "layers", "directions", "rows", "measured"), [
    # reserve spaces cuDNN 9.19 allocated on an H100 (benchmarks/recurrent/raw/rnn_kernel_h100_s23.json)
    ("lstm", 4, 512, 0, 2, 1, 16 * 128, 46_137_600),
    ("lstm", 2, 512, 0, 3, 1, 16 * 128, 35_651_840),
    ("lstm", 4, 1024, 256, 1, 1, 16 * 128, 52_429_056),
    ("lstm", 4, 1024, 0, 2, 2, 32 * 256, 738_197_760),
    ("gru", 4, 1536, 0, 3, 1, 16 * 512, 1_006_633_216),
    ("gru", 2, 512, 0, 1, 2, 16 * 128, 25_166_080),
    ("rnn_tanh", 4, 512, 0, 1, 1, 16 * 128, 4_194_560),
])
def test_reserve_space_is_what_cudnn_allocated(mode, dtype_bytes, hidden, proj, layers, directions, rows, measured):
    s = RecurrentShape(mode, 512, hidden, proj, layers, directions, rows // 16, rows, 16, dtype_bytes)
    assert reserve_bytes(s) == measured


def test_every_weight_gets_a_gradient_of_its_shape():
    module = nn.LSTM(16, 32, num_layers=2, proj_size=8, bidirectional=True, batch_first=True)
    shapes = [p.shape for p in module.parameters()]
    got = _trace(module, 2, 5)
    assert [g.shape for g in got["grads"]] == shapes


def test_autocast_runs_the_kernel_in_bf16_with_fp32_weight_gradients():
    got = _trace(nn.GRU(32, 32, batch_first=True), 4, 16, autocast=True)
    assert got["out"].dtype == torch.bfloat16
    assert all(g.dtype == torch.float32 for g in got["grads"])
    assert got["cost"].library_flops.get("bf16", 0) > 0 and not got["cost"].library_flops.get("fp32")


def test_flops_are_the_input_and_recurrent_products():
    got = _trace(nn.GRU(24, 32, num_layers=1, batch_first=True), 4, 10)
    forward = 2.0 * 3 * 32 * (24 + 32) * 4 * 10
    assert got["cost"].library_flops["fp32"] == pytest.approx(3 * forward)  # forward + backward (2x)


def test_real_tensors_keep_atens_path():
    torch.manual_seed(0)
    module = nn.LSTM(8, 16, num_layers=2, batch_first=True)
    x = torch.randn(3, 7, 8)
    expected, _ = module(x)
    with cuda_semantics(POLICY):
        got, _ = module(x)
    torch.testing.assert_close(got, expected)


def test_a_long_sequence_plans_in_seconds():
    class GRULM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(1000, 256)
            self.rnn = nn.GRU(256, 256, num_layers=3, batch_first=True)
            self.head = nn.Linear(256, 1000)

        def forward(self, input_ids, labels):
            h, _ = self.rnn(self.embed(input_ids))
            return {"loss": nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())}

    sample = {"input_ids": torch.zeros(8, 2048, dtype=torch.long), "labels": torch.zeros(8, 2048, dtype=torch.long)}
    # unrolled, 2048 steps x 3 layers made ~60k traced ops per variant, aligned and composed: minutes of planning
    plan = memopt.plan(GRULM(), sample, budget="8GiB", hardware="h200", use_cache=False)
    assert plan.strategy is not None
