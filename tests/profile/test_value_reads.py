"""Values a training step reads from its activations: a loss logged with ``.item()``, a NaN guard, a size made from
an activation. A fake-tensor trace has no values: the first two are traced as the step that trains reads them (a
stand-in float, finite values), and the step trains equal to the unwrapped loop; the third cannot be traced and is
refused in one line that says why."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt


class _Net(nn.Module):
    repairs = 0  # how often the isinf guard's branch ran, in any copy of the model (the traces run on copies)

    def __init__(self, guard: str = "") -> None:
        super().__init__()
        self.guard = guard
        self.a = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(3))
        self.o = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        for block in self.blocks:
            h = h + block(h)
            if self.guard == "isnan" and torch.isnan(h).any():
                raise FloatingPointError("NaN in a hidden state")
            if self.guard == "isfinite":
                assert torch.isfinite(h).all(), "a hidden state is not finite"
            if self.guard == "isinf" and bool(torch.isinf(h).any()):
                type(self).repairs += 1
                h = torch.nan_to_num(h)
        if self.guard == "size":
            n = int((h > 0).sum().item())  # a size from an activation's values
            h = h[:, : max(1, n % 32)]
            return self.o(F.pad(h, (0, 32 - h.shape[1])))
        return self.o(h)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(3)]


def _unwrapped(model: nn.Module, batches: list) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)  # memopt's AdamW default
    losses = []
    for x, y in batches:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _same_training(guard: str, **wrap_kwargs) -> memopt.Wrapped:
    if "training_step" not in wrap_kwargs:
        wrap_kwargs["loss_fn"] = lambda out, b: F.cross_entropy(out, b[1])
    torch.manual_seed(0)
    model = _Net(guard)
    ref = _Net(guard)
    ref.load_state_dict(model.state_dict())
    batches = _batches()
    w = memopt.wrap(model, budget="16GB", hardware="h100_80gb", sample=batches[0], lr=1e-2, guard=False,
                    pins={"checkpointing": "full", "micro_batch_size": 4}, **wrap_kwargs)
    losses = [w.step(b) for b in batches]
    assert losses == pytest.approx(_unwrapped(ref, batches), abs=1e-5)
    for p, q in zip(w.model.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-5)
    return w


def test_a_training_step_that_logs_its_loss_trains_as_the_unwrapped_loop():
    logged: list[float] = []

    def training_step(model: nn.Module, batch: tuple) -> torch.Tensor:
        loss = F.cross_entropy(model(batch[0]), batch[1])
        logged.append(loss.item())  # the plain loop's logging line
        return loss

    w = _same_training("", training_step=training_step)
    assert any(n.startswith("the training step reads floating values") for n in w.plan.notes)
    assert len(logged) >= 3  # the real steps logged real values (two micro-batches each)
    assert all(v != 1.0 for v in logged[-2:])


@pytest.mark.parametrize("guard", ["isnan", "isfinite", "isinf"])
def test_a_model_with_a_nan_guard_is_traced_as_the_step_that_trains(guard: str):
    w = _same_training(guard)
    assert not any(n.startswith("the training step reads floating values") for n in w.plan.notes)


def test_the_branch_a_finite_guard_skips_is_never_traced():
    model = _Net("isinf")
    _Net.repairs = 0
    plan = memopt.plan(model, (torch.randn(8, 16), torch.randint(0, 4, (8,))), budget="16GB",
                       hardware="h100_80gb", loss_fn=lambda out, b: F.cross_entropy(out, b[1]))
    assert plan.fits and _Net.repairs == 0


def test_a_size_made_from_an_activations_values_is_refused_saying_why():
    with pytest.raises(ValueError, match=r"integer tensor computed from the model's activations"):
        memopt.plan(_Net("size"), (torch.randn(8, 16), torch.randint(0, 4, (8,))), budget="16GB",
                    hardware="h100_80gb", loss_fn=lambda out, b: F.cross_entropy(out, b[1]))


def test_a_step_that_fails_in_the_trace_is_reported_without_the_fake_modes_log(caplog):
    """The fake mode logs a traceback for every op whose meta kernel fails, before it raises: thousands of lines
    ahead of memopt's one-line report of a model step that fails."""
    with pytest.raises(ValueError):
        memopt.plan(nn.Linear(16, 4), (torch.randn(8, 64), torch.randint(0, 4, (8,))), budget="16GB",
                    hardware="h100_80gb", loss_fn=lambda out, b: F.cross_entropy(out, b[1]))
    assert not [r for r in caplog.records if r.name.startswith("torch._subclasses")]
