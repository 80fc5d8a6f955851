"""Hooks the user registers on parameters (``Tensor.register_hook``, ``register_post_accumulate_grad_hook``) under
the precisions that store the weights in bf16 in new Parameter objects: they run on the parameters that train, as in
the hand-written bf16 master-weight loop (the model cast with ``model.bfloat16()``, which keeps its Parameter
objects and so their hooks; SGD on fp32 masters), and the unwrapped model's own parameters keep them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt

KW = {"budget": "4GB", "hardware": "h100_80gb", "device": "cpu"}
LR = 0.1


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 4))


def _batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def _ce(out: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(out, batch[1])


def _hook(kind: str, p: nn.Parameter, calls: list[int]) -> torch.utils.hooks.RemovableHandle:
    """A hook that scales ``p``'s gradient by 10, counting its calls."""
    if kind == "tensor":
        def scale(g: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            return g * 10
        return p.register_hook(scale)

    def scale_accumulated(q: torch.Tensor) -> None:
        calls[0] += 1
        q.grad.mul_(10)
    return p.register_post_accumulate_grad_hook(scale_accumulated)


def _bf16_master_loop(model: nn.Module, batches: list, loss_fn: Callable) -> None:
    masters = [p.detach().float().clone() for p in model.parameters()]
    model.bfloat16()
    for batch in batches:
        loss_fn(model(batch[0].bfloat16()), batch).backward()
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters):
                m -= LR * p.grad.float()
                p.copy_(m)
                p.grad = None


@pytest.mark.parametrize("kind", ["tensor", "post_accumulate"])
def test_parameter_hooks_run_under_bf16_master_as_in_the_hand_written_loop(kind):
    batches = _batches()
    reference, ref_calls = _mlp(), [0]
    _hook(kind, reference[2].weight, ref_calls)
    _bf16_master_loop(reference, batches, _ce)

    model, calls = _mlp(), [0]
    original = model[2].weight
    _hook(kind, original, calls)
    w = memopt.wrap(model, sample=batches[0], optimizer=torch.optim.SGD(model.parameters(), lr=LR), loss_fn=_ce,
                    fidelity="mixed", pins={"precision": "bf16_master", "micro_batch_size": 8}, **KW)
    for batch in batches:
        w.step(batch)
    assert calls[0] == ref_calls[0] == len(batches)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)

    # the unwrapped model trains with its own Parameter objects, which still hold the hook
    unwrapped = w.unwrap()
    assert unwrapped[2].weight is original
    _ce(unwrapped(batches[0][0]), batches[0]).backward()
    assert calls[0] == len(batches) + 1


def test_a_hook_removed_through_its_handle_after_the_wrap_stops_running():
    batches = _batches()
    model, calls = _mlp(), [0]
    handle = _hook("tensor", model[2].weight, calls)
    w = memopt.wrap(model, sample=batches[0], optimizer=torch.optim.SGD(model.parameters(), lr=LR), loss_fn=_ce,
                    fidelity="mixed", pins={"precision": "bf16_master"}, **KW)
    w.step(batches[0])
    handle.remove()
    w.step(batches[1])
    assert calls[0] == 1
