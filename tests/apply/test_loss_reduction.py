"""How the user's loss reduces over samples (memopt.step.loss_reduction): a summed loss trains through micro-batches
exactly as the unwrapped loop, a loss that couples the samples is refused before anything changes, and the check
leaves the model as it found it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt
from memopt.step.loss_reduction import LossNotSplittable, micro_batch_weights
from memopt.step.side_effects import side_effects_undone


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 5))


def _data(steps: int = 3, n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 12, generator=g), torch.randint(0, 5, (n,), generator=g)) for _ in range(steps)]


def _wrap(model: nn.Module, sample, micro: int, **kw):
    return memopt.wrap(model, budget="4GB", sample=sample, hardware="h100_80gb", device="cpu", use_cache=False,
                       guard=False, pins={"micro_batch_size": micro, "precision": "fp32"},
                       optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9), **kw)


def _unwrapped(model: nn.Module, batches, loss_of) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x, y in batches:
        loss = loss_of(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _summed(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="sum")


def _assert_trains_as_unwrapped(loss_of, measured: str, **kw) -> None:
    """Three steps at micro-batches of 2 equal the unwrapped loop over whole batches; the reduction is ``measured``."""
    batches = _data()
    ref = _mlp()
    want = _unwrapped(ref, batches, loss_of)
    model = _mlp()
    w = _wrap(model, batches[0], micro=2, **kw)
    got = [w.step(b) for b in batches]
    assert w._reduction.mode == measured
    assert got == pytest.approx(want, rel=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", ["loss_fn", "training_step", "declared"])
def test_a_summed_loss_trains_through_micro_batches_as_the_unwrapped_loop(how):
    """Weighted as a mean, each micro-batch's summed loss scaled the gradient by 1/4 (4 micro-batches of 2)."""
    kw = {"training_step": lambda m, b: _summed(m(b[0]), b[1])} if how == "training_step" else \
        {"loss_fn": lambda out, b: _summed(out, b[1])}
    if how == "declared":
        kw["loss_reduction"] = "sum"
    _assert_trains_as_unwrapped(_summed, "sum", **kw)


def test_a_mean_loss_is_measured_as_a_mean_and_stays_exact():
    _assert_trains_as_unwrapped(F.cross_entropy, "mean", loss_fn=lambda out, b: F.cross_entropy(out, b[1]))


def test_a_loss_that_couples_the_samples_is_refused_before_any_parameter_changes():
    """In-batch negatives (a contrastive loss over the batch's own pairs) cannot be split into micro-batches."""
    torch.manual_seed(0)
    model = nn.Linear(12, 12)
    before = copy.deepcopy(model.state_dict())
    x, y = torch.randn(8, 12), torch.randn(8, 12)

    def contrastive(out: torch.Tensor, batch) -> torch.Tensor:
        logits = F.normalize(out, dim=1) @ F.normalize(batch[1], dim=1).T / 0.1
        return F.cross_entropy(logits, torch.arange(len(out)))

    w = _wrap(model, (x, y), micro=2, loss_fn=contrastive)
    with pytest.raises(LossNotSplittable, match=r"neither a mean .* nor a sum"):
        w.step((x, y))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    # the whole batch in one micro-batch needs no check: it trains
    whole = _wrap(nn.Linear(12, 12), (x, y), micro=8, loss_fn=contrastive)
    assert whole.step((x, y)) > 0


def test_a_loss_with_noise_drawn_in_the_step_is_accumulated_as_a_mean_with_a_warning():
    """A diffusion-style training step samples noise and timesteps: the same samples give another loss each time, so
    the check cannot compare (it used to call the loss coupled and refuse it). It says why, accumulates a mean, and
    trains as an unwrapped loop that accumulates the same micro-batches (same draws, in the same order)."""

    def noisy_step(model: nn.Module, batch) -> torch.Tensor:
        x, _ = batch
        noise = torch.randn_like(x)
        t = torch.randint(1, 5, (x.shape[0], 1)).float()
        return F.mse_loss(model(x + noise / t)[:, :1], noise[:, :1])

    batches = _data()
    model, ref = _mlp(), _mlp()
    w = _wrap(model, batches[0], micro=2, training_step=noisy_step)
    torch.manual_seed(5)
    with pytest.warns(UserWarning, match=r"draws random numbers even in eval mode \(randint, randn_like"):
        got = [w.step(b) for b in batches]
    assert w._reduction.mode == "mean"
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    torch.manual_seed(5)
    want = []
    for x, y in batches:
        losses = [noisy_step(ref, (x[i:i + 2], y[i:i + 2])) for i in range(0, 8, 2)]
        sum(loss / 4 for loss in losses).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        want.append(sum(loss.item() for loss in losses) / 4)
    assert got == pytest.approx(want, rel=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_no_check_when_the_batch_is_not_split():
    batches = _data()
    w = _wrap(_mlp(), batches[0], micro=8, loss_fn=lambda out, b: _summed(out, b[1]))
    w.step(batches[0])
    assert w._reduction.mode == "auto"


class _Counting(nn.Module):
    """A buffer written in forward, a submodule the user keeps in eval mode, dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.5))
        self.frozen_norm = nn.BatchNorm1d(6).eval()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.calls = self.calls * 1  # a forward that rebinds its buffer rather than writing into it
        return self.frozen_norm(self.body(x))


def test_the_check_puts_back_modes_buffers_and_random_state():
    model = _Counting().train()
    model.frozen_norm.eval()
    calls = model.calls
    state = torch.get_rng_state()
    with side_effects_undone(model):
        assert not model.training
        model(torch.randn(4, 6))
    assert model.training and model.body.training and not model.frozen_norm.training
    assert model.calls is calls and float(model.calls) == 0.0
    assert torch.equal(torch.get_rng_state(), state)


def test_micro_batch_weights_by_hand():
    assert micro_batch_weights([3, 1], "mean") == [0.75, 0.25]
    assert micro_batch_weights([3, 1], "sum") == [1.0, 1.0]
    # two ranks averaging gradients: a mean over 8 global items, a sum undone by the world size
    assert micro_batch_weights([3, 1], "mean", world_size=2, total=8) == [0.75, 0.25]
    assert micro_batch_weights([3, 1], "sum", world_size=2) == [2.0, 2.0]


def test_a_bad_loss_reduction_is_one_line():
    with pytest.raises(ValueError, match="loss_reduction='avg'") as exc:
        _wrap(_mlp(), _data()[0], micro=2, loss_fn=lambda out, b: F.cross_entropy(out, b[1]), loss_reduction="avg")
    assert "Traceback" not in str(exc.value)


def _data_partly_labelled(ignore: int, steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Samples labelled ``ignore`` carry no loss: 1 of the first 4 and 3 of the last 4, so parts weigh unequally."""
    batches = _data(steps)
    for _, y in batches:
        y[[0, 5, 6, 7]] = ignore
    return batches


def test_a_mean_over_samples_the_labels_select_is_refused_before_any_parameter_changes():
    """A mean over the samples a mask keeps (here: labels other than -1) is weighted by the kept samples, which
    micro-batches weighted by their share of the batch would get wrong silently."""

    def kept(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        keep = y >= 0
        return F.cross_entropy(out[keep], y[keep])

    batches = _data_partly_labelled(-1)
    model = _mlp()
    before = copy.deepcopy(model.state_dict())
    w = _wrap(model, batches[0], micro=4, loss_fn=lambda out, b: kept(out, b[1]))
    with pytest.raises(LossNotSplittable,
                       match=r"weighted by their labels other than -100 .*a mean over items the batch's values"):
        w.step(batches[0])
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("micro", [4, 1])
def test_samples_labelled_minus_100_weigh_nothing_and_a_micro_batch_of_none_is_skipped(micro):
    """``F.cross_entropy``'s default ignore_index on per-sample labels: micro-batches are weighted by their labelled
    samples. At micro-batch 1, a sample labelled -100 is a micro-batch with nothing to average (0/0): skipped, not
    NaN."""
    batches = _data_partly_labelled(-100)
    ref = _mlp()
    want = _unwrapped(ref, batches, F.cross_entropy)
    model = _mlp()
    w = _wrap(model, batches[0], micro=micro, loss_fn=lambda out, b: F.cross_entropy(out, b[1]))
    got = [w.step(b) for b in batches]
    assert w._reduction.mode == "mean"
    assert got == pytest.approx(want, rel=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


class _NormalizesItsInput(nn.Module):
    """Writes into its input (``x.sub_(mean).div_(std)``): the check's forwards must not run on the batch itself."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.sub_(0.5).mul_(2.0)
        return self.body(x)


def test_the_check_leaves_a_batch_that_the_forward_writes_into_as_the_step_gets_it():
    batches = _data()
    ref = _NormalizesItsInput()
    want = _unwrapped(ref, [(x.clone(), y) for x, y in batches], F.cross_entropy)
    model = _NormalizesItsInput()
    w = _wrap(model, batches[0], micro=2, loss_fn=lambda out, b: F.cross_entropy(out, b[1]))
    got = [w.step((x.clone(), y)) for x, y in batches]
    assert w._reduction.mode == "mean"
    assert got == pytest.approx(want, rel=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def _semi_supervised(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the labelled samples beside a term over every sample (a penalty on the logits' size)."""
    return F.cross_entropy(out, y) + 0.5 * out.pow(2).sum(-1).mean()


def _first_pair_labelled() -> list[tuple[torch.Tensor, torch.Tensor]]:
    batches = _data()
    for _, y in batches:
        y[[2, 3, 6]] = -100  # the first micro-batch of 2 has one label in each half: equal counts
    return batches


def test_a_mean_over_labels_beside_a_term_over_every_sample_is_refused_even_where_the_first_micro_batch_is_even():
    """The check runs on samples of the whole batch chosen so that its halves carry unequal labels: the first
    micro-batch alone (one label in each half) cannot tell this loss from a mean over labels, and it trained wrong."""
    batches = _first_pair_labelled()
    model = _mlp()
    before = copy.deepcopy(model.state_dict())
    w = _wrap(model, batches[0], micro=2, loss_fn=lambda out, b: _semi_supervised(out, b[1]))
    with pytest.raises(LossNotSplittable, match=r"without those with no labels other than -100, which a split leaves"):
        w.step(batches[0])
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_mean_over_labels_alone_on_the_same_batches_still_trains_exactly():
    batches = _first_pair_labelled()
    ref = _mlp()
    want = _unwrapped(ref, batches, F.cross_entropy)
    model = _mlp()
    w = _wrap(model, batches[0], micro=2, loss_fn=lambda out, b: F.cross_entropy(out, b[1]))
    assert [w.step(b) for b in batches] == pytest.approx(want, rel=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_the_check_sample_puts_the_most_labelled_samples_in_one_half_and_the_fewest_in_the_other():
    from memopt.step.batch import split
    from memopt.step.loss_reduction import reduction_sample

    x = torch.arange(8).float().unsqueeze(1)
    labels = torch.tensor([[1, 1, -100], [-100] * 3, [1, 1, 1], [1, -100, -100],
                           [-100] * 3, [1, 1, 1], [1, -100, 1], [1, -100, -100]])
    micro = split({"x": x, "labels": labels}, 4)
    counts = [int((mb["labels"] != -100).sum()) for mb in micro]
    sample = reduction_sample(micro, counts)
    assert sample["x"].flatten().tolist() == [2.0, 5.0, 1.0, 4.0]  # three labels each, then none
    # every sample labelled alike: the first micro-batch with labels, as before
    even = split({"x": x, "labels": torch.ones(8, 3, dtype=torch.long)}, 4)
    assert reduction_sample(even, [12, 12]) is even[0]


def _masked_sum(out: torch.Tensor, b) -> torch.Tensor:
    """A squared error summed over the valid entries; the batch's first sample has none (a fully padded row)."""
    return (((out - b[2]) ** 2) * b[1]).sum()


def test_a_summed_loss_whose_first_sample_is_all_masked_is_measured_on_the_next_and_trains_exactly():
    """A loss of 0 is 0 given once or twice: the check takes the next part, where it told the sum from a mean. It
    gave up before ("could not tell") and accumulated the sum as a mean: gradients a quarter of the loop's."""
    g = torch.Generator().manual_seed(2)
    batches = []
    for _ in range(3):
        mask = (torch.rand(8, 5, generator=g) > 0.3).float()
        mask[0] = 0
        batches.append((torch.randn(8, 12, generator=g), mask, torch.randn(8, 5, generator=g)))
    ref = _mlp()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    want = []
    for b in batches:
        loss = _masked_sum(ref(b[0]), b)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        want.append(loss.item())
    model = _mlp()
    w = _wrap(model, batches[0], micro=2, training_step=lambda m, b: _masked_sum(m(b[0]), b))
    assert [w.step(b) for b in batches] == pytest.approx(want, rel=1e-5)
    assert w._reduction.mode == "sum"
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


class _TokenTagger(nn.Module):
    """Per-token classes; its loss a mean over the attention mask's tokens (labels are never -100), as ELECTRA's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 16)
        self.out = nn.Linear(16, 2)
        with torch.no_grad():  # near-zero logits: every token's loss about log 2, as a fresh model's
            self.out.weight.mul_(1e-3)
            self.out.bias.zero_()

    def forward(self, input_ids, attention_mask, labels):
        logits = self.out(torch.tanh(self.emb(input_ids)))
        per = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        m = attention_mask.flatten().float()
        return (per * m).sum() / m.sum()


def _tagged(pad: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    mask = torch.ones(8, 10, dtype=torch.long)
    if pad:
        for i in range(8):
            mask[i, 10 - i:] = 0  # right padding whose labels still carry a class
    return {"input_ids": torch.randint(0, 50, (8, 10), generator=g), "attention_mask": mask,
            "labels": torch.randint(0, 2, (8, 10), generator=g)}


def test_a_mean_over_the_attention_mask_that_the_losses_cannot_tell_from_one_over_labels_is_refused():
    """At initialisation every sample's loss is about log 2, so the whole batch's loss matches its halves weighted
    by labels and by the mask alike, while their gradients differ: it trained wrong (5e-3 in the parameters)."""
    model = _TokenTagger()
    before = copy.deepcopy(model.state_dict())
    w = _wrap(model, _tagged(pad=True), micro=2, training_step=lambda m, b: m(**b))
    with pytest.raises(LossNotSplittable, match=r"attention_mask leaves out positions whose labels carry loss"):
        w.step(_tagged(pad=True))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_the_same_loss_without_padding_and_a_mask_that_drops_only_minus_100_labels_still_split():
    """The mask keeps every labelled position (no padding; or padding labelled -100): a mean over the mask is the
    mean over the labels, and the split is exact."""
    batch = _tagged(pad=False)
    ref = _TokenTagger()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    loss = ref(**batch)
    loss.backward()
    opt.step()
    model = _TokenTagger()
    w = _wrap(model, batch, micro=2, training_step=lambda m, b: m(**b))
    assert w.step(batch) == pytest.approx(loss.item(), rel=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    padded = _tagged(pad=True)
    padded["labels"] = padded["labels"].masked_fill(padded["attention_mask"] == 0, -100)
    w2 = _wrap(_TokenTagger(), padded, micro=2, training_step=lambda m, b: m(**b))
    w2.step(padded)
    assert w2._reduction.mode == "mean"


def test_a_hugging_face_pre_training_head_is_refused_without_measuring():
    """BERT's pre-training loss adds a masked-LM mean over masked tokens and a next-sentence mean over samples: no
    weighting of micro-batches reproduces it, and at initialisation no measurement can see that."""
    transformers = pytest.importorskip("transformers")
    from memopt.step.loss_reduction import classify_reduction

    cfg = transformers.BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16)
    torch.manual_seed(0)
    model = transformers.BertForPreTraining(cfg)
    ids = torch.randint(0, 60, (4, 8))
    batch = {"input_ids": ids, "labels": ids.masked_fill(torch.rand(4, 8) < 0.5, -100),
             "next_sentence_label": torch.randint(0, 2, (4,))}
    verdict, why = classify_reduction(model, batch, None, precision="fp32", device_type="cpu")
    assert verdict == "terms" and "BertForPreTraining" in why
    # a loss of the user's own is measured, whatever the model (a mean over samples, where labels weigh the split)
    assert classify_reduction(model, batch, lambda out, b: out.prediction_logits.mean(), precision="fp32",
                              device_type="cpu")[0] == "masked"
