"""A sequence-first batch whose sequence is as long as its batch is large: every tensor agrees on dim 0, so nothing but
the recurrent layer says that dim 0 is the time steps, and a per-sample target makes the step fail on any part of the
batch. The batch is planned whole (not split into micro-batches, the plan saying why) and trains as the unwrapped
loop does; a pinned split, which cannot run, is refused in one line."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt
from memopt.profile.cuda_semantics import kernel_policy_for
from memopt.profile.sample_axis_probe import probe_batch
from memopt.profile.simulate import simulate_step
from memopt.profile.variant_trace import VariantKey
from memopt.strategy import Strategy

T = B = 8  # time steps and samples: the batch's tensors all have 8 rows along dim 0
FEATURES, CLASSES, LR = 4, 3, 0.05


class LastStep(nn.Module):
    """Classifies each sequence from the LSTM's last time step; the LSTM takes (time, batch, features)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.LSTM(FEATURES, 16), nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][-1])


def _loss(out: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(out, batch[1])


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(T, B, FEATURES, generator=g), torch.randint(0, CLASSES, (B,), generator=g)) for _ in range(n)]


def _wrap(model: nn.Module, **kwargs: object) -> memopt.Wrapped:
    return memopt.wrap(model, budget="8GB", sample=_batches(1)[0], hardware="h100_80gb", loss_fn=_loss,
                       fidelity="exact", optimizer="sgd", lr=LR, guard=False, autotune=False, use_cache=False,
                       **kwargs)


def test_the_batch_is_planned_whole_and_trains_as_the_unwrapped_loop() -> None:
    torch.manual_seed(0)
    model = LastStep()
    reference = copy.deepcopy(model)
    wrapped = _wrap(model)
    strategy = wrapped.plan.strategy
    assert (strategy.precision, strategy.micro_batch_size, strategy.grad_accum_steps) == ("fp32", B, 1)
    said = [n for n in wrapped.plan.notes if "micro-batching refused" in n]
    assert said and "LSTM rnn" in said[0] and f"runs on the whole batch of {B} only" in said[0]
    assert "traced and trained whole" in said[0]
    batches = _batches(3)
    got = [wrapped.step(b) for b in batches]
    opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=wrapped.optimizer.defaults["momentum"])
    want = []
    for b in batches:
        loss = _loss(reference(b[0]), b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(float(loss.detach()))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)


def test_the_estimate_is_of_the_whole_batch_step() -> None:
    model = LastStep()
    sample = _batches(1)[0]
    prof = memopt.profile(model, sample, hardware="h100_80gb", loss_fn=_loss, use_cache=False)
    strategy = Strategy(precision="fp32", optimizer="sgd", micro_batch_size=B, grad_accum_steps=1)
    est = memopt.estimate(prof, strategy, num_steps=3)
    sim = simulate_step(model, lambda device: tuple(t.to(device) for t in sample), strategy, loss_fn=_loss,
                        policy=kernel_policy_for(memopt.load_hardware("h100_80gb")), num_steps=3)
    assert est.peak_allocated_bytes == pytest.approx(sim.peak_allocated_bytes, rel=0.01)


def test_a_pinned_split_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError) as err:
        _wrap(LastStep(), pins={"micro_batch_size": 4})
    message = str(err.value)
    assert "\n" not in message
    assert f"runs on the whole batch of {B} only" in message
    assert f"micro-batches of 4 cannot run; leave micro_batch_size unpinned or pin it to {B}" in message


def test_the_probe_says_why_the_batch_runs_whole() -> None:
    sample = _batches(1)[0]

    def factory(b: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
        return sample[0][:b].to(device), sample[1][:b].to(device)

    probe = probe_batch(LastStep(), factory, _loss, B)
    assert probe is not None and probe.axis_refusal is not None and "LSTM rnn" in probe.axis_refusal
    assert probe.whole_batch is not None
    assert "Expected input batch_size (8) to match target batch_size (1)" in probe.whole_batch
    # a batch whose samples are along dim 0 is not held whole
    first = probe_batch(nn.Sequential(nn.Flatten(), nn.Linear(T * FEATURES, CLASSES)),
                        lambda b, device: (torch.randn(b, T, FEATURES, device=device),
                                           torch.zeros(b, dtype=torch.long, device=device)), _loss, B)
    assert first is not None and first.whole_batch is None


def test_a_cached_profile_traces_the_whole_batch() -> None:
    model, sample = LastStep(), _batches(1)[0]
    memopt.profile(model, sample, hardware="h100_80gb", loss_fn=_loss)
    cached = memopt.profile(model, sample, hardware="h100_80gb", loss_fn=_loss)
    assert cached.whole_batch is not None
    # a variant the first profile did not trace: made from the whole batch, as the first one was
    trace = cached.variant(VariantKey(precision="fp32", checkpointing="none"), micro_batch=B)
    assert trace.input_bytes[0] == trace.input_bytes[1] == sum(t.numel() * t.element_size() for t in sample)


class NodesOfOneGraph(nn.Module):
    """Full-graph training whose output has a row per node of the adjacency's columns: on part of the batch the
    loss, not the model, fails (a ValueError of F.cross_entropy)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(FEATURES, 16), nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        return self.out(adj.T @ F.relu(self.inp(x)))


def test_a_loss_that_fails_on_part_of_a_graph_batch_says_dim_0_is_not_samples() -> None:
    n = 10
    batch = (torch.randn(n, FEATURES), torch.eye(n), torch.randint(0, CLASSES, (n,)))

    def loss(out: torch.Tensor, b: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return F.cross_entropy(out, b[2])

    with pytest.raises(ValueError) as err:
        memopt.plan(NodesOfOneGraph(), batch, budget="8GB", hardware="h200", use_cache=False, loss_fn=loss)
    assert f"NodesOfOneGraph trains on the whole batch of {n} but not on one sample of it" in str(err.value)
