"""A training forward that writes the model's own state (a moving average, a counter, running minima) cannot be split
into micro-batches exactly: each micro-batch would update the state once, from part of the batch. The profile's
fake forward finds the persistent buffers written (in place or rebound) and refuses micro-batching with their names;
constants and caches (non-persistent buffers) and BatchNorm (refused on its own) are not named."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import memopt
from memopt.profile.sample_axis_probe import probe_batch
from tests.zoo.torch_patterns import PATTERNS


def _factory(b: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, 8, device=device), torch.randint(0, 3, (b,), device=device)


def _loss(out: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(out, batch[1])


class _WithState(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
        self.register_buffer("ema", torch.zeros(8))
        self.register_buffer("cache", torch.zeros(8), persistent=False)
        self.register_buffer("x_max", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "ema":
            with torch.no_grad():
                self.ema.mul_(0.9).add_(0.1 * x.mean(0))
        elif self.how == "view":
            self.ema[:4].add_(1.0)  # through a view of the buffer
        elif self.how == "rebound":
            self.x_max = torch.maximum(self.x_max, x.detach().abs().max())  # a new tensor, not a write
        elif self.how == "cache":
            self.cache.copy_(x.mean(0).detach())  # a non-persistent buffer: a cache, not state
        return self.body(x - self.ema)


def _refusal(how: str) -> str | None:
    probe = probe_batch(_WithState(how), _factory, _loss)
    assert probe is not None
    return probe.state_refusal


def test_written_state_is_named_in_place_through_a_view_or_rebound() -> None:
    assert "buffer(s) ema " in _refusal("ema")
    assert "buffer(s) ema " in _refusal("view")
    assert "buffer(s) x_max " in _refusal("rebound")


def test_constants_caches_and_batch_norm_are_not_state_writes() -> None:
    assert _refusal("none") is None
    assert _refusal("cache") is None
    bn = nn.Sequential(nn.Unflatten(1, (2, 4)), nn.BatchNorm1d(2), nn.Flatten(), nn.Linear(8, 3))
    probe = probe_batch(bn, _factory, _loss)
    assert probe is not None and probe.state_refusal is None


def test_the_plan_keeps_the_whole_batch_and_says_why() -> None:
    """At a budget where splitting would otherwise be free to choose, the plan refuses it with the buffer's name;
    a pinned micro-batch size is still honoured (the user's call)."""
    pat = next(p for p in PATTERNS if p.name == "buffer_updated_in_forward")
    plan = memopt.plan(pat.build(), pat.sample(8), budget="10GB", hardware="h200", loss_fn=pat.loss_fn)
    assert plan.strategy.micro_batch_size == 8
    assert any("micro-batching refused (it would not be exact): its training forward updates the buffer(s) mean"
               in n for n in plan.notes)
    pinned = memopt.plan(pat.build(), pat.sample(8), budget="10GB", hardware="h200", loss_fn=pat.loss_fn,
                         pins={"micro_batch_size": 2})
    assert pinned.strategy.micro_batch_size == 2


class _Counted(nn.Module):
    """State kept in plain attributes: a call counter that anneals a temperature, or a length cache filled once."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.calls = 0
        self.longest = 0
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "counter" and self.training:
            self.calls += 1
        elif self.how == "cache":
            self.longest = max(self.longest, x.shape[1])  # settles at the first call: not state that moves
        return self.body(x) / max(0.1, 1.0 - 0.1 * self.calls)


def test_a_counter_kept_in_a_plain_attribute_refuses_micro_batching_and_a_settled_cache_does_not() -> None:
    """Split 8 into 2s, the counter reached 16 after 4 steps where the loop's reached 4: the temperature ran ahead
    and the parameters differed by 4e-3, with no word."""
    counter = probe_batch(_Counted("counter"), _factory, _loss)
    assert counter is not None and "attribute(s) calls " in (counter.state_refusal or "")
    cache = probe_batch(_Counted("cache"), _factory, _loss)
    assert cache is not None and cache.state_refusal is None
    model = _Counted("counter")
    plan = memopt.plan(model, _factory(8, "cpu"), budget="10GB", hardware="h200", loss_fn=_loss, use_cache=False)
    assert plan.strategy.micro_batch_size == 8
    assert any("updates the attribute(s) calls" in n for n in plan.notes)
    assert model.calls == 0  # planning ran the forward on a fake copy only


def test_a_batch_norm_the_user_keeps_in_eval_is_traced_in_eval_and_splits_to_one_sample() -> None:
    """Frozen-BatchNorm fine-tuning: the model in training mode, its backbone's BatchNorm in eval. The trace put every
    module in training mode, so a micro-batch of one failed BatchNorm's two-sample minimum and wrap raised."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU()), nn.Linear(16, 3))
    model.train()
    model[0].eval()
    plan = memopt.plan(model, _factory(8, "cpu"), budget="10GB", hardware="h200", loss_fn=_loss, use_cache=False,
                       pins={"micro_batch_size": 1})
    assert plan.fits and plan.strategy.micro_batch_size == 1
    assert model.training and not model[0][1].training  # the user's modes, as given
