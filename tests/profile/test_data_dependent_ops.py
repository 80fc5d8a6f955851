"""Ops whose output size depends on values beyond selections (``unique``, ``unique_consecutive``, ``bincount``,
``repeat_interleave`` with a tensor of repeats): traced at their real size where the trace has the values, at their
largest where it has not, and refused in one line where nothing bounds them; models that use them (BART's sequence
classifier, a class-balanced loss) plan and train as an unwrapped loop does."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import memopt
from memopt.profile.data_dependent import UnboundedOutput
from memopt.profile.profile import VariantFailed
from memopt.profile.tracker import MemoryTracker

CLASSES, WIDTH, BATCH = 3, 8, 6
LR = 0.05

# (name, op on a tensor) for every flavour of the unique family torch.unique and torch.unique_consecutive reach
UNIQUE_CALLS: list[tuple[str, Callable[[torch.Tensor], Any]]] = [
    ("unique", lambda t: torch.unique(t)),
    ("unique unsorted", lambda t: torch.unique(t, sorted=False)),
    ("unique inverse counts", lambda t: torch.unique(t, return_inverse=True, return_counts=True)),
    ("unique counts", lambda t: torch.unique(t, return_counts=True)),
    ("unique dim", lambda t: torch.unique(t, dim=0, return_inverse=True)),
    ("unique dim 1 counts", lambda t: torch.unique(t, dim=1, return_counts=True)),
    ("unique_consecutive", lambda t: torch.unique_consecutive(t)),
    ("unique_consecutive inverse counts", lambda t: torch.unique_consecutive(t, return_inverse=True,
                                                                            return_counts=True)),
    ("unique_consecutive dim", lambda t: torch.unique_consecutive(t, dim=1, return_counts=True)),
    ("legacy _unique", lambda t: torch._unique(t, return_inverse=True)),
]


def _shapes(out: Any) -> list[tuple[int, ...]]:
    return [tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else (out,))]


def _traced(fn: Callable[..., Any], *tensors: torch.Tensor, shadowed: bool) -> tuple[Any, set[str]]:
    """``fn`` on fake copies of ``tensors`` under a tracker (their values given to it as shadows, or not): its
    output shapes, and the ops the tracker bounded."""
    with FakeTensorMode() as mode, MemoryTracker("cpu") as tracker:
        fakes = [mode.from_tensor(t) for t in tensors]
        if shadowed:
            for fake, real in zip(fakes, tensors):
                tracker.shadows.adopt(fake, real)
        out = fn(*fakes)
        shapes = _shapes(out)
    return shapes, tracker.run.bounded_ops


@pytest.mark.parametrize("name,call", UNIQUE_CALLS, ids=[n for n, _ in UNIQUE_CALLS])
def test_the_unique_family_is_traced_at_its_real_size_or_its_largest(name: str, call: Callable) -> None:
    repeated = torch.tensor([[3, 3, 1, 4], [3, 3, 1, 4], [0, 0, 2, 2]])
    # the values the trace has: the real op's shapes, nothing bounded
    shapes, bounded = _traced(call, repeated, shadowed=True)
    assert shapes == _shapes(call(repeated)) and not bounded
    # values it has not: the shapes of a tensor whose every element (and slice) is distinct, the largest there is
    distinct = torch.arange(repeated.numel()).reshape(repeated.shape)
    shapes, bounded = _traced(call, repeated, shadowed=False)
    assert shapes == _shapes(call(distinct)) and bounded, name


def test_a_sorted_set_of_narrow_values_is_bounded_by_the_dtype() -> None:
    flags = torch.rand(64) > 0.5
    assert _traced(torch.unique, flags, shadowed=False)[0] == [(2,)]  # two booleans at most
    bytes_ = torch.randint(0, 256, (1000,), dtype=torch.uint8)
    assert _traced(torch.unique, bytes_, shadowed=False)[0] == [(256,)]
    # a run of booleans may alternate: as many runs as elements
    assert _traced(torch.unique_consecutive, flags, shadowed=False)[0] == [(64,)]


def test_bincount_has_the_real_number_of_bins_where_the_values_are_known() -> None:
    labels = torch.tensor([0, 4, 1, 1])
    weights = torch.rand(4)
    assert _traced(torch.bincount, labels, shadowed=True) == ([(5,)], set())
    shapes, _ = _traced(lambda x: torch.bincount(x, minlength=7), labels, shadowed=True)
    assert shapes == [(7,)]
    # the weights set the dtype, not the size; their values are not needed
    with FakeTensorMode() as mode, MemoryTracker("cpu") as tracker:
        fake = mode.from_tensor(labels)
        tracker.shadows.adopt(fake, labels)
        counted = torch.bincount(fake, weights=mode.from_tensor(weights))
        assert (tuple(counted.shape), counted.dtype) == ((5,), torch.float32)


def test_bincount_of_narrow_unknown_values_is_bounded_by_the_dtype() -> None:
    codes = torch.randint(0, 4, (10,), dtype=torch.uint8)
    shapes, bounded = _traced(torch.bincount, codes, shadowed=False)
    assert shapes == [(256,)] and bounded == {"bincount.default"}


def test_bincount_and_repeat_interleave_of_unknown_wide_values_say_what_would_bound_them() -> None:
    counts = torch.randint(0, 4, (10,))
    with pytest.raises(UnboundedOutput, match=r"torch\.bincount of int64 values the trace cannot know.*fixed bins"):
        _traced(torch.bincount, counts, shadowed=False)
    with pytest.raises(UnboundedOutput, match=r"torch\.repeat_interleave .*pass output_size="):
        _traced(torch.repeat_interleave, counts, shadowed=False)
    # with its output size given, or its repeats known, it traces
    assert _traced(lambda r: torch.repeat_interleave(r, output_size=40), counts, shadowed=False)[0] == [(40,)]
    assert _traced(torch.repeat_interleave, counts, shadowed=True)[0] == [(int(counts.sum()),)]
    rows = torch.randn(10, 4)
    shapes, _ = _traced(lambda r, x: torch.repeat_interleave(x, r, dim=0), counts, rows, shadowed=True)
    assert shapes == [(int(counts.sum()), 4)]


# -- plain modules -------------------------------------------------------------------------------------------------

class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(WIDTH, 32), nn.GELU(), nn.Linear(32, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _balanced_loss(out: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy weighted by the inverse frequency of each class in the batch."""
    y = batch[1]
    weight = 1.0 / torch.bincount(y, minlength=CLASSES).clamp(min=1).float()
    return F.cross_entropy(out, y, weight=weight)


class DedupedEmbedding(nn.Module):
    """Looks each distinct id up once (a recommender's sparse features), and checks, as BART's classification head
    does, that every row holds as many end tokens (``unique_consecutive`` of their counts) before pooling at the
    last one."""

    END = 19

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(20, WIDTH), nn.Linear(WIDTH, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        distinct, inverse = torch.unique(ids, return_inverse=True)
        hidden = self.emb(distinct)[inverse]
        ends = ids.eq(self.END)
        if torch.unique_consecutive(ends.sum(1)).numel() != 1:
            raise ValueError("every row must hold as many end tokens")
        return self.head(hidden[ends, :].view(ids.size(0), -1, WIDTH)[:, -1, :])


def _ids_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, DedupedEmbedding.END, (BATCH, 5), generator=g)
    ids[:, -1] = DedupedEmbedding.END
    return ids, torch.randint(0, CLASSES, (BATCH,), generator=g)


def _vectors_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)


def _train_both(build: Callable[[], nn.Module], batches: list[Any], **wrap_kwargs: Any
                ) -> tuple[memopt.Wrapped, list[float], list[float]]:
    """3 steps through ``memopt.wrap`` (fp32, SGD with momentum as the zoo plans it) and 3 of the unwrapped loop with
    the same optimizer, from the same weights: (wrapped, its losses, the loop's losses)."""
    torch.manual_seed(0)
    model = build()
    reference = copy.deepcopy(model)
    wrapped = memopt.wrap(model, budget="8GB", sample=batches[0], hardware="h100_80gb", fidelity="exact",
                          optimizer="sgd", lr=LR, use_cache=False, guard=False, autotune=False, **wrap_kwargs)
    assert wrapped.plan.strategy.precision == "fp32" and wrapped.plan.strategy.optimizer == "sgd"
    got = [wrapped.step(b) for b in batches]
    opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=wrapped.optimizer.defaults["momentum"])
    loss_fn = wrap_kwargs.get("loss_fn")
    want = []
    for b in batches:
        if isinstance(b, dict):
            loss = reference(**b).loss
        else:
            out = reference(*b[:-1]) if loss_fn is not None else reference(*b)
            loss = loss_fn(out, b) if loss_fn is not None else out
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(float(loss.detach()))
    return wrapped, got, want


def test_a_class_balanced_loss_trains_as_the_unwrapped_loop() -> None:
    g = torch.Generator().manual_seed(1)
    batches = [_vectors_batch(g) for _ in range(3)]
    _, got, want = _train_both(Classifier, batches, loss_fn=_balanced_loss)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)


def test_unique_and_unique_consecutive_in_forward_train_as_the_unwrapped_loop() -> None:
    g = torch.Generator().manual_seed(2)
    batches = [_ids_batch(g) for _ in range(3)]
    _, got, want = _train_both(DedupedEmbedding, batches,
                               loss_fn=lambda out, batch: F.cross_entropy(out, batch[1]))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)


class CountsUnknownValues(nn.Module):
    """Selects by values computed from floats (the trace has none): distinct sign patterns, and a histogram of how
    many features of each row are positive."""

    def __init__(self, bincount: bool) -> None:
        super().__init__()
        self.bincount = bincount
        self.body = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        positive = (h > 0).long()
        if self.bincount:
            return h.mean() + torch.bincount(positive.sum(1)).float().mean()
        patterns = torch.unique(positive, dim=0)
        return h.mean() + patterns.float().mean()


def test_unique_of_unknown_values_is_planned_at_its_largest_and_said() -> None:
    plan = memopt.plan(CountsUnknownValues(bincount=False), sample=torch.randn(BATCH, WIDTH), budget="4GB",
                       hardware="h100_80gb", use_cache=False)
    assert any("unique_dim" in note and "largest" in note for note in plan.notes), plan.notes


def test_bincount_of_unknown_values_is_refused_in_one_line() -> None:
    with pytest.raises(VariantFailed) as err:
        memopt.plan(CountsUnknownValues(bincount=True), sample=torch.randn(BATCH, WIDTH), budget="4GB",
                    hardware="h100_80gb", use_cache=False)
    message = str(err.value)
    assert "\n" not in message
    assert "UnboundedOutput: torch.bincount of int64 values the trace cannot know" in message
    assert "F.one_hot(x, num_classes).sum(0)" in message


# -- BART's sequence classifier -------------------------------------------------------------------------------------

def _bart() -> nn.Module:
    import transformers

    config = transformers.BartConfig(vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=64, num_labels=CLASSES, dropout=0.0,
                                     attention_dropout=0.0, activation_dropout=0.0, classifier_dropout=0.0)
    torch.manual_seed(0)
    return transformers.BartForSequenceClassification(config).train()


def _bart_batches(n: int) -> list[dict[str, torch.Tensor]]:
    """Token rows that end in BART's end-of-sequence token (2) and hold no other, as a tokenizer makes them."""
    g = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(n):
        ids = torch.randint(3, 128, (4, 10), generator=g)
        ids[:, -1] = 2
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                        "labels": torch.randint(0, CLASSES, (4,), generator=g)})
    return batches


def test_bart_sequence_classifier_trains_as_the_unwrapped_loop() -> None:
    batches = _bart_batches(3)
    wrapped, got, want = _train_both(_bart, batches)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    assert wrapped.plan.fits
