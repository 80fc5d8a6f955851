"""Trailing padding cut off each micro-batch under memopt.wrap(model).step(batch): where the loss (the model's own,
or the user's loss_fn) is measured unchanged by right padding, a micro-batch's columns that are padding in all its
rows are dropped before its forward, and training equals the unwrapped loop over the whole padded batch. Where the
loss sees padded positions, or the batch has no attention mask, every micro-batch keeps the batch's width."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import memopt
from memopt.models import build_model

STEPS = 3
PINS = {"micro_batch_size": 2, "precision": "fp32", "optimizer": "sgd"}
LR = 0.1


def _padded(lengths: list[int], width: int, seed: int) -> dict[str, torch.Tensor]:
    """Rows of ``lengths`` random tokens right-padded to ``width``: id 0, mask 0 and label -100 at the pads."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(3, 64, (n,), generator=g)
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.where(mask.bool(), ids, -100)}


def _batches() -> list[dict[str, torch.Tensor]]:
    # the longest row sits in a different micro-batch each step; the others are far shorter
    return [_padded([5, 3, 24, 4, 6, 2], 24, 0), _padded([20, 19, 4, 3, 2, 5], 20, 1),
            _padded([3, 4, 5, 6, 7, 16], 16, 2)]


def _llama() -> nn.Module:
    torch.manual_seed(0)
    return build_model("tiny_llama", device="cpu")


def _widths_seen(model: nn.Module) -> list[int]:
    seen: list[int] = []

    def record(module, args, kwargs):
        if module.training:
            seen.append(kwargs["input_ids"].shape[1] if "input_ids" in kwargs else args[0].shape[1])

    model.register_forward_pre_hook(record, with_kwargs=True)
    return seen


def _plain(model: nn.Module, batches, loss_fn=None) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)  # memopt's "sgd"
    losses = []
    for batch in batches:
        out = model(**{k: v for k, v in batch.items() if k != "target"})
        loss = out.loss if loss_fn is None else loss_fn(out, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def _wrapped(model: nn.Module, batches, loss_fn=None):
    wrapped = memopt.wrap(model, budget="4GB", hardware="h100_80gb", sample=batches[0], pins=PINS,
                          optimizer_kwargs={"lr": LR}, loss_fn=loss_fn, guard=False)
    widths = _widths_seen(wrapped.model)
    losses = [wrapped.step(batch) for batch in batches]
    return wrapped, widths, losses


def _assert_same(plain_model: nn.Module, wrapped_model: nn.Module, plain: list[float], losses: list[float]) -> None:
    assert losses == pytest.approx(plain, rel=1e-5)
    for name, value in plain_model.named_parameters():
        torch.testing.assert_close(wrapped_model.get_parameter(name), value, rtol=1e-5, atol=1e-6)


def test_each_micro_batch_runs_at_its_own_longest_row_and_trains_as_the_whole_batch():
    batches = _batches()
    plain_model = _llama()
    plain = _plain(plain_model, batches)
    wrapped, widths, losses = _wrapped(_llama(), batches)
    # micro-batches of two rows: each one cut to its own longest row
    expected = [max(b["attention_mask"][i:i + 2].sum(1)).item() for b in batches for i in range(0, 6, 2)]
    assert widths == expected
    assert sum(widths) < sum(3 * b["input_ids"].shape[1] for b in batches)
    _assert_same(plain_model, wrapped.model, plain, losses)
    assert any(n.startswith("trailing padding is cut off each micro-batch") for n in wrapped.plan.notes)


def _pooled_over_every_position(output, batch) -> torch.Tensor:
    """A per-sample classification loss over logits mean-pooled across all positions, padded ones included: cutting
    padding would change it."""
    return nn.functional.cross_entropy(output.logits.float().mean(dim=1)[:, :3], batch["target"])


def test_a_loss_fn_that_reads_padded_positions_keeps_every_column_and_trains_the_same():
    batches = [{"input_ids": b["input_ids"], "attention_mask": b["attention_mask"],
                "target": torch.arange(6) % 3} for b in _batches()]
    plain_model = _llama()
    plain = _plain(plain_model, batches, _pooled_over_every_position)
    wrapped, widths, losses = _wrapped(_llama(), batches, _pooled_over_every_position)
    assert widths == [b["input_ids"].shape[1] for b in batches for _ in range(3)]
    _assert_same(plain_model, wrapped.model, plain, losses)
    note = next(n for n in wrapped.plan.notes if n.startswith("each micro-batch keeps the whole batch's padding"))
    assert "column(s) of right padding" in note


def test_a_batch_without_an_attention_mask_is_neither_measured_nor_noted():
    batches = [{k: v for k, v in b.items() if k != "attention_mask"} for b in _batches()]
    wrapped, widths, _ = _wrapped(_llama(), batches)
    assert widths == [b["input_ids"].shape[1] for b in batches for _ in range(3)]
    assert not any("padding" in n for n in wrapped.plan.notes)


def _phi3_longrope() -> nn.Module:
    """Rotary factors that switch from short to long past 16 positions: a micro-batch of short rows cut below 16
    runs with other frequencies than the whole batch, padded to 24, ran with."""
    import transformers

    torch.manual_seed(0)
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, original_max_position_embeddings=16, pad_token_id=0,
        rope_scaling={"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [4.0] * 4},
        resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0))


def test_a_cut_that_crosses_a_length_the_model_switches_at_keeps_every_column_and_trains_the_same():
    """The check cuts the micro-batch that loses the most columns: appending padding to one already past 16 told
    nothing, and the cut micro-batches trained with the short factors (parameters 5.6e-3 apart)."""
    batches = [_padded([24, 22, 20, 18, 16, 14, 12, 10], 24, seed) for seed in range(STEPS)]
    plain_model = _phi3_longrope()
    plain = _plain(plain_model, batches)
    wrapped, widths, losses = _wrapped(_phi3_longrope(), batches)
    assert widths == [24] * 4 * STEPS
    _assert_same(plain_model, wrapped.model, plain, losses)
    note = next(n for n in wrapped.plan.notes if n.startswith("each micro-batch keeps the whole batch's padding"))
    assert "trailing padding column(s) cut" in note


class _ConvFrontEnd(nn.Module):
    """Two convolutions over the frames (a speech encoder's front end), then a per-frame head: the second one reads
    the first one's bias at padded frames, so cutting padding moves the last real frames' outputs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, 8)
        self.conv1 = nn.Conv1d(8, 16, 5, padding=2)
        self.conv2 = nn.Conv1d(16, 16, 5, padding=2)
        self.head = nn.Linear(16, 64)

    def forward(self, input_ids, attention_mask, labels):
        h = self.conv2(torch.relu(self.conv1(self.emb(input_ids).transpose(1, 2)))).transpose(1, 2)
        return type("Out", (), {"loss": nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())})()


def test_a_convolution_over_padded_frames_keeps_every_column():
    batches = [_padded([40, 38, 30, 28, 20, 18, 12, 10], 40, seed) for seed in range(STEPS)]
    wrapped, widths, _ = _wrapped(_ConvFrontEnd(), batches)
    assert widths == [40] * 4 * STEPS
    assert any(n.startswith("each micro-batch keeps the whole batch's padding") for n in wrapped.plan.notes)
