"""The script's batch under ``memopt.wrap(trainer)``, against the plain Trainer on the same seed and data: checkpoints
describe the script's batch (a resume with ``auto_find_batch_size`` across memopt and plain runs keeps the global
batch), and a per-sample Python list a collator keeps beside the tensors is split with the rows."""

from __future__ import annotations

import pytest
import torch

import memopt
from memopt.step import batch_samples
from memopt.step.train_step import split_batch

transformers = pytest.importorskip("transformers")


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32))


def _rows(n: int = 32, seq: int = 8) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": (ids := torch.randint(3, 128, (seq,), generator=g)), "labels": ids.clone(),
             "attention_mask": torch.ones(seq, dtype=torch.long), "text": f"row{i}"} for i in range(n)]


def _params(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _losses(trainer) -> list[float]:
    return [r["loss"] for r in trainer.state.log_history if "loss" in r]


def _wrap(trainer, **pins):
    return memopt.wrap(trainer, budget="4GB", hardware="h100_80gb", fidelity="exact", pins=pins or None)


# -- checkpoints -------------------------------------------------------------------------------------------------
def _resumable(out, steps: int):
    torch.manual_seed(0)
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=steps,
        learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0, report_to=[], use_cpu=True,
        save_strategy="steps", save_steps=2, logging_steps=1, seed=0, data_seed=0, disable_tqdm=True,
        auto_find_batch_size=True, include_num_input_tokens_seen=True, remove_unused_columns=True)
    rows = [{k: v for k, v in r.items() if k != "text"} for r in _rows()]
    return transformers.Trainer(model=_llama(), args=args, train_dataset=rows)


def _resumed(tmp_path, first: bool, second: bool):
    out = tmp_path / f"{first}-{second}"
    t1 = _resumable(out, 2)
    (_wrap(t1, micro_batch_size=1) if first else t1).train()
    t2 = _resumable(out, 4)
    t2 = _wrap(t2, micro_batch_size=1) if second else t2
    t2.train(resume_from_checkpoint=True)
    return t2


@pytest.mark.parametrize(("first", "second"), [(False, True), (True, False), (True, True)])
def test_a_resume_with_auto_find_batch_size_keeps_the_global_batch(tmp_path, first, second):
    """memopt's checkpoint held its own per-device batch (the global batch, with one accumulation step), which a
    resume under ``auto_find_batch_size`` took for the loader's: a plain run then trained on 2 x the batch, and a
    run under memopt resumed from a plain checkpoint on half of it."""
    plain = _resumed(tmp_path, False, False)
    mixed = _resumed(tmp_path, first, second)
    seen = [r["num_input_tokens_seen"] for r in mixed.state.log_history if "loss" in r]
    assert seen == [r["num_input_tokens_seen"] for r in plain.state.log_history if "loss" in r] == [32, 64, 96, 128]
    expected = _params(plain)
    for name, value in _params(mixed).items():
        torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=1e-5)


def test_memopt_checkpoints_hold_the_script_batch_arguments(tmp_path):
    trainer = _wrap(_resumable(tmp_path, 2), micro_batch_size=1)
    trainer.train()
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (4, 1)
    saved = torch.load(tmp_path / "checkpoint-2" / "training_args.bin", weights_only=False)
    assert (saved.per_device_train_batch_size, saved.gradient_accumulation_steps, saved.auto_find_batch_size) == \
        (2, 2, True)
    state = transformers.TrainerState.load_from_json(str(tmp_path / "checkpoint-2" / "trainer_state.json"))
    assert state.train_batch_size == 2


# -- per-sample lists --------------------------------------------------------------------------------------------
def _collate(rows: list[dict]) -> dict:
    batch = {k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "labels", "attention_mask")}
    return {**batch, "text": [r["text"] for r in rows]}


class PairedTexts(transformers.Trainer):
    """A loss that pairs the batch's texts with its rows (as a teacher scoring the same rows would)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        texts = inputs.pop("text")
        assert len(texts) == inputs["input_ids"].shape[0], f"{len(texts)} texts for {inputs['input_ids'].shape[0]}"
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def _texts_trainer(path, cls=PairedTexts):
    torch.manual_seed(0)
    args = transformers.TrainingArguments(
        output_dir=str(path), per_device_train_batch_size=4, max_steps=3, learning_rate=0.5, optim="sgd",
        lr_scheduler_type="constant", max_grad_norm=0.0, report_to=[], use_cpu=True, save_strategy="no",
        logging_steps=1, seed=0, data_seed=0, disable_tqdm=True, remove_unused_columns=False)
    return cls(model=_llama(), args=args, train_dataset=_rows(16), data_collator=_collate)


@pytest.mark.parametrize("pins", [{}, {"micro_batch_size": 2}])
def test_a_per_sample_list_is_split_with_the_rows(tmp_path, pins):
    """Every micro-batch (and the 1- and 2-sample profile) was handed all the texts: ``wrap`` refused, blaming the
    model. The list goes with its rows now, and the training is the plain Trainer's."""
    plain = _texts_trainer(tmp_path / "plain")
    plain.train()
    wrapped = _wrap(_texts_trainer(tmp_path / "memopt"), **pins)
    wrapped.train()
    assert _losses(wrapped) == pytest.approx(_losses(plain), rel=1e-5)
    expected = _params(plain)
    for name, value in _params(wrapped).items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6)


def test_per_sample_lists_split_and_others_are_named():
    batch = {"x": torch.arange(8).reshape(4, 2), "text": ["a", "b", "c", "d"], "ids": (0, 1, 2, 3),
             "names": ["p", "q"]}
    parts = split_batch(batch, 2)
    assert [p["text"] for p in parts] == [["a", "b"], ["c", "d"]]
    assert [p["ids"] for p in parts] == [(0, 1), (2, 3)]
    assert [p["names"] for p in parts] == [["p", "q"], ["p", "q"]]  # not per sample: handed to every one whole
    assert batch_samples.batch_size(batch) == 4 and batch_samples.indivisible(batch) is None
    assert batch_samples.unsplit_lists(batch) == ["names (2 items beside 4 samples)"]


def test_a_list_not_one_item_per_sample_is_named_in_the_refusal(tmp_path):
    """Two texts per row, flattened: memopt cannot tell which go with which row and hands every sample all of them,
    which the script's loss rejects; the refusal names the list instead of blaming the model alone."""
    class TwoTexts(PairedTexts):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            inputs["text"] = inputs["text"][::2]
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    trainer = _texts_trainer(tmp_path, TwoTexts)
    trainer.data_collator = lambda rows: {**_collate(rows), "text": [t for r in rows for t in (r["text"], "")]}
    with pytest.raises(ValueError, match=r"text \(8 items beside 4 samples\)"):
        _wrap(trainer)
