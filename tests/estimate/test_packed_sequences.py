"""Recurrent models fed packed sequences (``pack_padded_sequence``, the usual loop over variable-length batches):
the trace sizes the packed rows from the lengths (every sequence at full length where the batch's values are not
known), gives the recurrent kernels ``batch_sizes`` they can read, and the composed estimate equals the simulation
of the same step; ``memopt.wrap`` trains such a model as the unwrapped loop does."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import memopt
from memopt.profile.cuda_semantics import kernel_policy_for
from memopt.profile.simulate import simulate_step
from memopt.step.batch import as_loss
from memopt.strategy import Strategy


class PackedLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.rnn = nn.LSTM(32, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, 3)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(self.embed(ids), lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, _ = self.rnn(packed)
        padded, _ = pad_packed_sequence(out, batch_first=True, total_length=ids.shape[1])
        return self.head(padded.mean(1))


def _batch(n: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 50, (n, 12), generator=g), torch.randint(1, 13, (n,), generator=g),
            torch.randint(0, 3, (n,), generator=g))


def _step(m, b):
    return nn.functional.cross_entropy(m(b[0], b[1]), b[2])


@pytest.mark.parametrize("mb", [1, 8])
def test_estimate_equals_simulation(mb):
    model, sample = PackedLSTM(), _batch()
    prof = memopt.profile(model, sample, hardware="h200", use_cache=False, training_step=_step)
    strategy = Strategy(micro_batch_size=mb, grad_accum_steps=8 // mb)
    est = memopt.estimate(prof, strategy, num_steps=3)
    sim = simulate_step(model, lambda d: tuple(torch.zeros_like(t, device=d) for t in sample), strategy,
                        policy=kernel_policy_for(memopt.load_hardware("h200")), num_steps=3,
                        loss_fn=as_loss(None, _step))
    assert est.peak_allocated_bytes == pytest.approx(sim.peak_allocated_bytes, rel=0.01)


def test_wrap_trains_a_packed_model_as_the_unwrapped_loop():
    torch.manual_seed(0)
    model = PackedLSTM()
    reference = PackedLSTM()
    reference.load_state_dict(model.state_dict())
    wrapped = memopt.wrap(model, budget="8GB", hardware="h200", sample=_batch(), training_step=_step, optimizer="sgd",
                          lr=0.1, pins={"precision": "fp32", "micro_batch_size": 4}, use_cache=False)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)  # memopt's sgd
    for seed in range(3):
        batch = _batch(seed=seed)
        got = float(wrapped.step(batch))
        opt.zero_grad()
        loss = _step(reference, batch)
        loss.backward()
        opt.step()
        assert got == pytest.approx(float(loss), rel=1e-5, abs=1e-6)
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
