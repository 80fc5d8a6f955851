"""CTC losses (``F.ctc_loss``, Hugging Face's ``*ForCTC`` heads): ``aten._ctc_loss`` keeps ``log_alpha`` of
(batch, time, 2 * longest target + 1), a size the target lengths' values set, so the fake trace cannot size it
itself. It is traced at its real size where the trace knows the lengths, at the targets' bound where it does not;
CTC models plan and train as the unwrapped loop, through micro-batches where the loss's weighting allows, and a
Hugging Face CTC head's mean (per-sample means over target lengths) is refused for micro-batches with that reason."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import memopt
from memopt.profile.tracker import MemoryTracker
from memopt.step.loss_reduction import LossNotSplittable
from tests.reference_loop import losses_of_plain_loop

BATCH, STEPS, CLASSES, LONGEST = 8, 20, 6, 5


def _ctc_shapes(lengths: Any, shadowed: bool, targets_dim: int = 2) -> tuple[list[tuple[int, ...]], set[str]]:
    """The output shapes of ``_ctc_loss`` on fake log-probabilities and targets (the lengths' values given to the
    tracker as shadows, or not), and the ops the tracker bounded."""
    log_probs = torch.randn(STEPS, BATCH, CLASSES).log_softmax(-1)
    targets = torch.randint(1, CLASSES, (BATCH, LONGEST) if targets_dim == 2 else (BATCH * LONGEST,))
    with FakeTensorMode() as mode, MemoryTracker("cpu") as tracker:
        fakes = [mode.from_tensor(t) for t in (log_probs, targets)]
        if isinstance(lengths, torch.Tensor):
            fake_lengths = mode.from_tensor(lengths)
            if shadowed:
                tracker.shadows.adopt(fake_lengths, lengths)
            out = torch.ops.aten._ctc_loss.Tensor(*fakes, torch.full((BATCH,), STEPS), fake_lengths)
        else:
            out = torch.ops.aten._ctc_loss.default(*fakes, [STEPS] * BATCH, lengths)
        shapes = [tuple(t.shape) for t in out]
    return shapes, tracker.run.bounded_ops


def test_ctc_is_traced_at_the_longest_target_where_the_lengths_are_known():
    lengths = [2, 3, 1, 3, 2, 3, 1, 2]
    assert _ctc_shapes(lengths, shadowed=False) == ([(BATCH,), (BATCH, STEPS, 7)], set())
    assert _ctc_shapes(torch.tensor(lengths), shadowed=True) == ([(BATCH,), (BATCH, STEPS, 7)], set())


@pytest.mark.parametrize("targets_dim,longest", [(2, LONGEST), (1, BATCH * LONGEST)])
def test_ctc_of_unknown_lengths_is_traced_at_the_targets_bound(targets_dim, longest):
    """Padded targets bound every length by their width; concatenated ones by all of them in one."""
    shapes, bounded = _ctc_shapes(torch.full((BATCH,), 2), shadowed=False, targets_dim=targets_dim)
    assert shapes == [(BATCH,), (BATCH, STEPS, 2 * longest + 1)]
    assert bounded == {"_ctc_loss.Tensor"}


class _Acoustic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))
        self.out = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.out(h).log_softmax(-1)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, STEPS, 8, generator=g), torch.randint(1, CLASSES, (BATCH, LONGEST), generator=g),
             torch.randint(1, LONGEST + 1, (BATCH,), generator=g)) for _ in range(3)]


def _assert_same_training(model: nn.Module, reference: nn.Module, got: list[float], want: list[float]) -> None:
    assert got == pytest.approx(want, rel=1e-5)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_ctc_model_trains_through_micro_batches_as_the_unwrapped_loop(reduction):
    """The wrap failed on the trace (DynamicOutputShapeException: aten._ctc_loss). 'mean' averages each sample's loss
    over its target length, then over the samples: the micro-batches weigh by samples."""
    def step(m: nn.Module, b: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, targets, lengths = b
        return F.ctc_loss(m(x).transpose(0, 1), targets, torch.full((x.shape[0],), STEPS), lengths,
                          reduction=reduction)

    batches = _batches()
    torch.manual_seed(0)
    reference = _Acoustic()
    model = copy.deepcopy(reference)
    want = losses_of_plain_loop(reference, batches, step, torch.optim.SGD(reference.parameters(), lr=1e-3))
    w = memopt.wrap(model, budget="4GB", sample=batches[0], hardware="h100_80gb", device="cpu", use_cache=False,
                    guard=False, training_step=step, pins={"micro_batch_size": 2, "precision": "fp32"},
                    optimizer=lambda params: torch.optim.SGD(params, lr=1e-3))
    assert w.plan.fits and w.plan.total_bytes > 0
    got = [w.step(b) for b in batches]
    assert w._reduction.mode == reduction
    _assert_same_training(model, reference, got, want)


def _wav2vec2(reduction: str) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
        vocab_size=12, mask_time_prob=0.0, ctc_loss_reduction=reduction, pad_token_id=0, hidden_dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0)
    return transformers.Wav2Vec2ForCTC(config)


def _speech_batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    batches = []
    for _ in range(3):
        labels = torch.randint(1, 12, (4, 5), generator=g)
        labels[0, 2:] = -100  # targets of other lengths: padded with -100
        labels[1, 4:] = -100
        batches.append({"input_values": torch.randn(4, 800, generator=g), "labels": labels})
    return batches


def _wrap_speech(model: nn.Module, sample: Any, micro: int | None) -> memopt.Wrapped:
    pins: dict[str, Any] = {"precision": "fp32"} | ({} if micro is None else {"micro_batch_size": micro})
    return memopt.wrap(model, budget="4GB", sample=sample, hardware="h100_80gb", device="cpu", use_cache=False,
                       guard=False, pins=pins, optimizer=lambda params: torch.optim.SGD(params, lr=1e-3))


@pytest.mark.parametrize("reduction,micro", [("sum", 2), ("mean", None)])
def test_wav2vec2_for_ctc_trains_as_the_unwrapped_loop(reduction, micro):
    batches = _speech_batches()
    reference = _wav2vec2(reduction)
    model = copy.deepcopy(reference)
    want = losses_of_plain_loop(reference, batches, lambda m, b: m(**b).loss,
                                torch.optim.SGD(reference.parameters(), lr=1e-3))
    w = _wrap_speech(model, batches[0], micro)
    got = [w.step(b) for b in batches]
    _assert_same_training(model, reference, got, want)


def test_wav2vec2_for_ctc_mean_is_refused_for_micro_batches_with_its_reason_before_any_parameter_changes():
    """Weighted by their labels other than -100 the micro-batches would not give the per-sample mean's gradient."""
    batches = _speech_batches()
    model = _wav2vec2("mean")
    before = [p.detach().clone() for p in model.parameters()]
    w = _wrap_speech(model, batches[0], micro=2)
    with pytest.raises(LossNotSplittable, match=r"^Wav2Vec2ForCTC's own CTC loss \(config.ctc_loss_reduction='mean'\) "
                                                r"divides each sample's loss by its target length .*set "
                                                r"ctc_loss_reduction='sum' in the model's config"):
        w.step(batches[0])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
