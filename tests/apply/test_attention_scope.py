"""A planned attention backend restricts SDPA only while memopt runs the model: its forward passes, its backward
passes (the recomputation of checkpointed blocks included) and a hand-written forward under ``Wrapped.autocast``.
Between steps, while the model stays wrapped, every other model in the process keeps the flags the user had."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt

_CUDA = torch.backends.cuda
# which SDPA kernels were allowed at each call, and where the call came from
Seen = list[tuple[str, tuple[bool, bool, bool, bool]]]


def _flags() -> tuple[bool, bool, bool, bool]:
    return (_CUDA.flash_sdp_enabled(), _CUDA.mem_efficient_sdp_enabled(), _CUDA.cudnn_sdp_enabled(),
            _CUDA.math_sdp_enabled())


class Block(nn.Module):
    def __init__(self, width: int, seen: Seen) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.seen = seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a graph task is running only inside backward: there, a checkpointed block's forward is its recomputation
        self.seen.append(("backward" if torch._C._current_graph_task_id() >= 0 else "forward", _flags()))
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, -1)).permute(2, 0, 3, 1, 4).unbind(0)  # (batch, heads, seq, dim)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(a.transpose(1, 2).flatten(-2))


class Net(nn.Module):
    def __init__(self, seen: Seen, width: int = 32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, seen) for _ in range(3))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x).mean(dim=(1, 2))


def test_the_planned_backend_holds_in_memopts_passes_and_nowhere_else():
    user_flags = _flags()
    only_math = (False, False, False, True)
    assert user_flags != only_math  # torch's default allows every kernel
    seen: Seen = []
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 8, 32, generator=g), torch.randn(4, generator=g)) for _ in range(2)]
    loss_fn = lambda out, b: F.mse_loss(out, b[1])  # noqa: E731
    w = memopt.wrap(Net(seen), budget="4GB", sample=batches[0], hardware="h100_80gb", loss_fn=loss_fn,
                    pins={"attention": "math", "checkpointing": "full", "precision": "fp32"}, guard=False,
                    autotune=False, optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    assert w.plan.strategy.attention == "math" and w.plan.strategy.checkpointing.count(3) >= 1
    assert _flags() == user_flags  # wrapped, between steps: the user's flags
    seen.clear()
    w.step(batches[0])
    assert {where for where, _ in seen} == {"forward", "backward"}  # checkpointed blocks recomputed in backward
    assert all(flags == only_math for _, flags in seen), seen
    assert _flags() == user_flags

    other: Seen = []
    Net(other)(batches[1][0])  # a second model beside the wrapped one (an evaluation, a teacher)
    assert [flags for _, flags in other] == [user_flags] * 3

    seen.clear()
    with w.autocast():  # a hand-written forward runs under the plan's kernel too
        loss = loss_fn(w.model(batches[1][0]), batches[1])
    w.backward(loss)
    w.optimizer_step()
    assert seen and all(flags == only_math for _, flags in seen), seen
    assert _flags() == user_flags


def test_the_flags_are_put_back_when_a_pass_raises():
    seen: Seen = []
    x, y = torch.randn(4, 8, 32), torch.randn(4)
    fail = [False]

    def loss_fn(out: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if fail[0]:
            raise RuntimeError("the user's loss failed")
        return F.mse_loss(out, batch[1])

    w = memopt.wrap(Net(seen), budget="4GB", sample=(x, y), hardware="h100_80gb", loss_fn=loss_fn,
                    pins={"attention": "math"}, guard=False, autotune=False)
    user_flags = _flags()
    w.step((x, y))
    fail[0] = True
    with pytest.raises(RuntimeError, match="the user's loss failed"):
        w.step((x, y))  # raised inside memopt's forward pass
    assert _flags() == user_flags
    with pytest.raises(RuntimeError, match="the user's loss failed"), w.autocast():
        loss_fn(w.model(x), (x, y))  # raised inside a hand-written forward
    assert _flags() == user_flags
