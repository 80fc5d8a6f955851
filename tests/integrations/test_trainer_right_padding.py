"""Trailing padding cut off each micro-batch under memopt.wrap(trainer): the collator padded the whole batch to its
longest row, and a micro-batch's columns that are padding in all its rows (and carry no loss token) are dropped
before its forward where the model's loss is measured to be unchanged by right padding. Training is that of the
unwrapped Trainer at the same global batch; a model whose loss sees padded positions keeps them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import memopt  # noqa: E402 -- after the importorskips
from memopt.models import build_model  # noqa: E402
from memopt.step.right_padding import padding_invariant, trailing_padding, trim_right  # noqa: E402

STEPS = 3
GLOBAL = 8
PINS = {"micro_batch_size": 1, "precision": "fp32", "optimizer": "sgd"}


def _batch(lengths: list[int], width: int, *, label_at: dict[tuple[int, int], int] | None = None):
    """Rows of ``lengths`` real tokens right-padded to ``width``: pad id 0, mask 0 and labels -100 at the pads."""
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.arange(3, 3 + n)
        mask[i, :n] = 1
    labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
    for (i, j), v in (label_at or {}).items():
        labels[i, j] = v
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


# -- trailing_padding / trim_right ------------------------------------------------------------------------------------
def test_trailing_padding_counts_the_columns_padded_in_every_row():
    micro = [_batch([3, 2], 6), _batch([6], 6), _batch([1, 4, 2], 6)]
    assert trailing_padding(micro) == [3, 0, 2]


def test_a_label_inside_the_padding_stops_the_trim_and_one_column_always_stays():
    # column 3 is padding in both rows, but row 0 has a loss token there: only the columns after it go
    assert trailing_padding([_batch([2, 2], 6, label_at={(0, 3): 7})]) == [2]
    # a micro-batch of padding only keeps one column, so no forward sees an empty sequence
    empty = {"input_ids": torch.zeros(2, 5, dtype=torch.long), "attention_mask": torch.zeros(2, 5, dtype=torch.long),
             "labels": torch.full((2, 5), -100)}
    assert trailing_padding([empty]) == [4]


def test_batches_without_a_2d_attention_mask_have_no_trailing_padding():
    b = _batch([2, 1], 5)
    no_mask = {k: v for k, v in b.items() if k != "attention_mask"}
    mask_4d = {**b, "attention_mask": b["attention_mask"][:, None, None, :]}
    float_targets = {**b, "labels": torch.zeros(2, 5)}  # no ignore index: no column is known to carry no loss
    assert trailing_padding([no_mask, mask_4d, (b["input_ids"], b["labels"]), b["input_ids"], float_targets]) == [
        0, 0, 0, 0, 0]


def test_trim_right_cuts_the_per_token_tensors_and_keeps_the_container():
    b = _batch([3, 2], 6)
    enc = transformers.BatchEncoding({**b, "embeds": torch.randn(2, 6, 4), "class_labels": torch.tensor([1, 0]),
                                      "pixels": torch.randn(2, 3, 8), "name": "x"})
    out = trim_right(enc, 3)
    assert type(out) is transformers.BatchEncoding
    for key in ("input_ids", "attention_mask", "labels", "embeds"):
        assert torch.equal(out[key], enc[key][:, :3]) and out[key].is_contiguous(), key
    assert out["class_labels"] is enc["class_labels"] and out["pixels"] is enc["pixels"] and out["name"] == "x"
    assert trim_right(enc, 6) is enc
    plain = trim_right(b, 4)
    assert type(plain) is dict and plain["input_ids"].shape == (2, 4)
    with pytest.raises(ValueError):
        trim_right(b, 0)


def test_trailing_padding_reads_all_micro_batches_back_in_one_sync(monkeypatch):
    calls = {"tolist": 0, "scalar": 0}
    tolist = torch.Tensor.tolist

    def counted(self, *a, **kw):
        calls["tolist"] += 1
        return tolist(self, *a, **kw)

    def scalar(self, *a, **kw):
        calls["scalar"] += 1
        raise AssertionError("a per-micro-batch read-back")

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    for name in ("item", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, scalar)
    assert trailing_padding([_batch([3, 2], 6), _batch([6], 6), _batch([1], 6), _batch([2, 5], 6)]) == [3, 0, 5, 1]
    assert calls == {"tolist": 1, "scalar": 0}


# -- padding_invariant ----------------------------------------------------------------------------------------------
class _MeanPooled(nn.Module):
    """A classifier that mean-pools its embeddings over every position, the mask ignored: padding is in its loss."""

    def __init__(self, vocab: int = 64, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 16)
        self.head = nn.Linear(16, classes)

    def forward(self, input_ids, attention_mask=None, labels=None):
        logits = self.head(self.embed(input_ids).mean(dim=1))
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return transformers.modeling_outputs.SequenceClassifierOutput(loss=loss, logits=logits)


def _llama():
    torch.manual_seed(0)
    return build_model("tiny_llama", device="cpu")


def _bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64, num_labels=3, pad_token_id=0)
    return transformers.BertForSequenceClassification(config)


def _classified(lengths: list[int], width: int):
    b = _batch(lengths, width)
    return {**b, "labels": torch.arange(len(lengths)) % 3}


def test_padding_invariant_holds_for_a_causal_lm_and_leaves_training_state_alone():
    model = _llama()
    model.train()
    rng = torch.random.get_rng_state()
    ok, why = padding_invariant(model, _batch([7, 4, 5], 7))
    assert ok, why
    assert model.training and all(m.training for m in model.modules())
    assert torch.equal(torch.random.get_rng_state(), rng)


def test_padding_invariant_holds_for_a_bert_sequence_classifier():
    ok, why = padding_invariant(_bert(), _classified([6, 3, 4], 6))
    assert ok, why


def test_padding_invariant_fails_where_padded_positions_reach_the_loss():
    torch.manual_seed(0)
    ok, why = padding_invariant(_MeanPooled(), _classified([6, 3, 4], 6))
    assert not ok, "a mean over all positions, mask ignored, changes with every padding column"
    assert "column(s) of right padding" in why
    assert padding_invariant(_llama(), {"input_ids": torch.ones(2, 4, dtype=torch.long)}) == (
        False, "the batch has no 2-D attention_mask")


# -- under the Trainer -------------------------------------------------------------------------------------------------
def _tokenizer():
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(61)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                                unk_token="<unk>", padding_side="right")


def _rows(per_sample_labels: bool, n: int = GLOBAL * STEPS) -> list[dict[str, object]]:
    """Tokenized rows of very uneven lengths (3 to 24 tokens), as an SFT or classification script leaves them."""
    g = torch.Generator().manual_seed(5)
    rows = []
    for _ in range(n):
        length = int(torch.randint(3, 25, (1,), generator=g))
        ids = torch.randint(3, 64, (length,), generator=g).tolist()
        if per_sample_labels:
            labels: object = int(torch.randint(0, 3, (1,), generator=g))
        else:
            prompt = int(torch.randint(0, length - 1, (1,), generator=g))
            labels = [-100] * prompt + ids[prompt:]  # the prompt carries no loss, the answer does
        rows.append({"input_ids": ids, "attention_mask": [1] * length, "labels": labels})
    return rows


def _trainer(tmp_path, model, *, per_sample_labels: bool):
    tok = _tokenizer()
    collator = (transformers.DataCollatorWithPadding(tok) if per_sample_labels
                else transformers.DataCollatorForSeq2Seq(tok, label_pad_token_id=-100))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=GLOBAL, gradient_accumulation_steps=1,
        max_steps=STEPS, learning_rate=1e-1, lr_scheduler_type="constant", optim="sgd", report_to=[], use_cpu=True,
        save_strategy="no", logging_steps=1, seed=0, data_seed=0, disable_tqdm=True)
    return transformers.Trainer(model=model, args=args, train_dataset=_rows(per_sample_labels), data_collator=collator)


def _widths_seen(model: nn.Module) -> list[tuple[int, int]]:
    """(sequence width, real tokens) of each training forward's batch."""
    seen: list[tuple[int, int]] = []

    def record(module, args, kwargs):
        if module.training:
            mask = kwargs["attention_mask"]
            seen.append((mask.shape[1], int(mask.sum())))

    model.register_forward_pre_hook(record, with_kwargs=True)
    return seen


def _assert_same_training(plain, wrapped) -> None:
    losses = [r["loss"] for r in wrapped.state.log_history if "loss" in r]
    plain_losses = [r["loss"] for r in plain.state.log_history if "loss" in r]
    assert len(losses) == STEPS and losses == pytest.approx(plain_losses, rel=1e-5)
    for name, value in plain.model.named_parameters():
        torch.testing.assert_close(wrapped.model.get_parameter(name), value, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("smoothing", [0.0, 0.1], ids=["model_loss", "label_smoothing"])
def test_a_wrapped_trainer_runs_each_micro_batch_at_its_own_length_and_trains_the_same(tmp_path, smoothing):
    """The model's own loss, or the Trainer's label smoother over its logits (checked through compute_loss)."""
    def make(path):
        trainer = _trainer(path, _llama(), per_sample_labels=False)
        if smoothing:
            trainer.args.label_smoothing_factor = smoothing
            trainer.label_smoother = transformers.trainer_pt_utils.LabelSmoother(epsilon=smoothing)
        return trainer

    plain = make(tmp_path / "plain")
    plain_widths = _widths_seen(plain.model)
    plain.train()
    wrapped = memopt.wrap(make(tmp_path / "memopt"), budget="4GB", hardware="h100_80gb", pins=PINS)
    assert wrapped.args.per_device_train_batch_size == GLOBAL and wrapped.args.gradient_accumulation_steps == 1
    widths = _widths_seen(wrapped.model)
    wrapped.train()
    assert len(plain_widths) == STEPS and len(widths) == GLOBAL * STEPS
    # each row ran at its own length (no padding column), and each step's longest row at the batch's width
    assert all(width == tokens for width, tokens in widths), widths
    for step, (width, _) in enumerate(plain_widths):
        assert max(w for w, _ in widths[step * GLOBAL:(step + 1) * GLOBAL]) == width
    assert sum(w for w, _ in widths) < sum(GLOBAL * w for w, _ in plain_widths)
    _assert_same_training(plain, wrapped)
    assert wrapped.memopt_recovery.padding.on is True
    assert any(n.startswith("trailing padding is cut off each micro-batch") for n in wrapped.memopt_plan.notes)


def test_a_model_whose_loss_sees_padding_trains_untrimmed_and_the_same(tmp_path):
    def model():
        torch.manual_seed(0)
        return _MeanPooled()

    plain = _trainer(tmp_path / "plain", model(), per_sample_labels=True)
    plain_widths = _widths_seen(plain.model)
    plain.train()
    wrapped = memopt.wrap(_trainer(tmp_path / "memopt", model(), per_sample_labels=True), budget="4GB",
                          hardware="h100_80gb", pins=PINS)
    widths = _widths_seen(wrapped.model)
    wrapped.train()
    # every micro-batch kept the whole batch's width: its padding is part of this model's loss
    assert [w for w, _ in widths] == [w for w, _ in plain_widths for _ in range(GLOBAL)]
    _assert_same_training(plain, wrapped)
    assert wrapped.memopt_recovery.padding.on is False
    note = next(n for n in wrapped.memopt_plan.notes if n.startswith("each micro-batch keeps the whole batch's"))
    assert "column(s) of right padding" in note


@pytest.fixture(params=[False, True], ids=["one_process", "process_group"])
def process_group(request, monkeypatch):
    """Optionally a one-process gloo group: accelerate then wraps the Trainer's model in DDP, after it wrapped the
    model's forward in autocast, so the check must step around the wrapper on ``DDP.module``."""
    import torch.distributed as dist

    if not request.param:
        yield False
        return
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield True
    finally:
        dist.destroy_process_group()


def test_under_mixed_precision_the_padding_check_runs_the_forward_in_fp32(tmp_path, process_group):
    """accelerate wraps the forward in bf16 autocast; a bf16 forward at two sequence lengths differs by more than
    the check's 1e-4 even where the model is invariant, so the check runs the model's own forward (fp32 weights)."""
    wrapped = memopt.wrap(_trainer(tmp_path, _llama(), per_sample_labels=False), budget="4GB",
                          hardware="h100_80gb", pins={**PINS, "precision": "bf16_autocast"})
    widths = _widths_seen(wrapped.model)
    autocast_in_eval: list[bool] = []  # inside the model's forward (a layer's hook): the check's passes run in eval
    wrapped.model.model.layers[0].register_forward_pre_hook(
        lambda m, args: autocast_in_eval.append(torch.is_autocast_enabled("cpu")) if not m.training else None)
    wrapped.train()
    assert autocast_in_eval and not any(autocast_in_eval)  # the checks' passes, in fp32
    assert isinstance(wrapped.model_wrapped, torch.nn.parallel.DistributedDataParallel) == process_group
    assert wrapped.accelerator.mixed_precision == "bf16"
    assert "_original_forward" in wrapped.model.__dict__  # the autocast wrapper the check steps around
    assert wrapped.memopt_recovery.padding.on is True, wrapped.memopt_recovery.padding.reason
    assert all(width == tokens for width, tokens in widths), widths
