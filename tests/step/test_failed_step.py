"""A step that fails part-way (the user's loss raising on a later micro-batch, a bad batch, an interrupt) did not
happen: the gradients its earlier micro-batches accumulated must not reach the next step."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)) for _ in range(3))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


@pytest.mark.parametrize("pins", [
    {"precision": "fp32"},
    {"precision": "fp32", "checkpointing": "full", "activation_offload": True},
    {"precision": "bf16_master"},
], ids=["fp32", "checkpointed+offloaded", "bf16-master"])
def test_a_step_that_failed_part_way_leaves_no_gradients(pins: dict) -> None:
    torch.manual_seed(0)
    model = _Blocks()
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    calls = {"n": 0, "fail_at": None}

    def loss_fn(out: torch.Tensor, batch: tuple) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == calls["fail_at"]:
            raise RuntimeError("the user's loss failed on this micro-batch")
        return F.cross_entropy(out, batch[1])

    clean = copy.deepcopy(model)
    w_clean = memopt.wrap(clean, budget="4GB", hardware="h100_80gb", sample=(x, y), loss_fn=loss_fn, lr=1e-2,
                          pins={**pins, "micro_batch_size": 2}, fidelity="mixed")
    for _ in range(2):
        w_clean.step((x, y))

    failing = copy.deepcopy(model)
    w = memopt.wrap(failing, budget="4GB", hardware="h100_80gb", sample=(x, y), loss_fn=loss_fn, lr=1e-2,
                    pins={**pins, "micro_batch_size": 2}, fidelity="mixed")
    w.step((x, y))
    calls["fail_at"] = calls["n"] + 2  # the second micro-batch of the next step
    with pytest.raises(RuntimeError, match="the user's loss failed"):
        w.step((x, y))
    assert w.steps_done == 1
    assert all(p.grad is None for p in failing.parameters())
    calls["fail_at"] = None
    w.step((x, y))
    for a, b in zip(failing.parameters(), clean.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("batch_kind", ["tuple", "dict", "training_step"])
def test_bf16_weights_take_float_inputs_as_a_bf16_loop_does(batch_kind: str) -> None:
    # a model whose weights the plan casts to bf16 gets its floating-point inputs in bf16, as a hand-written pure-bf16
    # loop casts them (a bf16 Linear refuses fp32 input); targets keep their dtype for the user's loss
    torch.manual_seed(0)
    model = _Blocks()
    x, y = torch.randn(4, 8), torch.randn(4, 3)
    kwargs: dict = {}
    if batch_kind == "tuple":
        batch: object = (x, y)
        kwargs["loss_fn"] = lambda out, b: F.mse_loss(out.float(), b[1])
    elif batch_kind == "dict":
        class Keyed(nn.Module):
            def __init__(self, inner: nn.Module) -> None:
                super().__init__()
                self.inner = inner

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.inner(x)

        model = Keyed(model)
        batch = {"x": x, "y": y}
        kwargs["loss_fn"] = lambda out, b: F.mse_loss(out.float(), b["y"])
    else:
        batch = (x, y)
        kwargs["training_step"] = lambda m, b: F.mse_loss(m(b[0]).float(), b[1].float())
    hand = copy.deepcopy(model).to(torch.bfloat16)
    opt = torch.optim.AdamW(hand.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
    expected = []
    for _ in range(3):
        opt.zero_grad()
        loss = F.mse_loss(hand(x.to(torch.bfloat16)).float(), y)
        loss.backward()
        opt.step()
        expected.append(float(loss))
    w = memopt.wrap(model, budget="4GB", hardware="h100_80gb", sample=batch, lr=1e-2, fidelity="lossy",
                    pins={"precision": "bf16_pure", "optimizer": "adamw_fused"}, **kwargs)
    assert [w.step(batch) for _ in range(3)] == pytest.approx(expected, rel=1e-6)
