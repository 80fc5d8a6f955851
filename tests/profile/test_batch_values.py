"""A custom model's batch is traced with the values a model reads from it: each integer tensor filled with the
largest value the real batch holds. A model that trims its padding to ``lengths.max()`` was traced with zeros,
at length 0: its activations vanished from the estimate (34 KB of 126 MB)."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import memopt
from memopt.step.batch_like import integer_maxima, like
from memopt.strategy import Strategy

HW = memopt.load_hardware("h200")


class TrimsPadding(nn.Module):
    def __init__(self, trim: bool = True) -> None:
        super().__init__()
        self.trim = trim
        self.emb = nn.Embedding(50, 64)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 256), nn.GELU(),
                                                  nn.Linear(256, 64)) for _ in range(3))
        self.head = nn.Linear(64, 3)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        n = int(lengths.max()) if self.trim else ids.shape[1]
        h = self.emb(ids[:, :n])
        for b in self.blocks:
            h = h + b(h)
        return self.head(h.mean(1))


def _loss(out, batch):
    return F.cross_entropy(out, batch[2])


def _batch(longest: int, width: int = 256):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, longest + 1, (8,), generator=g)
    lengths[3] = longest
    return torch.randint(0, 50, (8, width), generator=g), lengths, torch.randint(0, 3, (8,), generator=g)


def _activations(model, batch, use_cache=False):
    prof = memopt.profile(model, batch, hardware=HW, loss_fn=_loss, use_cache=use_cache)
    return memopt.estimate(prof, Strategy(precision="fp32", micro_batch_size=8)).breakdown["activations"]


def test_a_model_trimming_to_the_longest_row_is_traced_at_that_length():
    full = _activations(TrimsPadding(trim=False), _batch(256))
    assert _activations(TrimsPadding(), _batch(256)) == full
    half = _activations(TrimsPadding(), _batch(128))
    assert half == pytest.approx(full / 2, rel=0.1)


def test_profiles_of_batches_with_other_values_are_not_shared():
    assert _activations(TrimsPadding(), _batch(64), use_cache=True) < \
        _activations(TrimsPadding(), _batch(192), use_cache=True)


def test_the_fill_is_each_integer_tensors_largest_value():
    labels = torch.tensor([[-100, 4], [2, -100]])
    batch = {"x": torch.randn(2, 3), "labels": labels, "mask": torch.ones(2, 2, dtype=torch.bool),
             "meta": torch.empty(2, 5, dtype=torch.long, device="meta")}
    assert integer_maxima(batch) == [None, 4, None, None]
    made = like(batch, 3, "cpu", integer_maxima(batch))
    assert made["labels"].tolist() == [[4, 4]] * 3 and made["meta"].tolist() == [[0] * 5] * 3
    assert made["mask"].dtype == torch.bool and not made["mask"].any() and made["x"].shape == (3, 3)
