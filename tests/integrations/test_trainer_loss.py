"""A Trainer whose loss is not its model's own (label smoothing, a subclass's compute_loss) is planned from the step
it runs: label smoothing takes a log-softmax of the logits, which the model's own loss does not."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import memopt
from memopt.integrations.trainer_loss import trainer_loss
from memopt.models import build_model

SEQ, BATCH, VOCAB = 32, 8, 256


def _trainer(tmp_path, cls=None, **kw):
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": (ids := torch.randint(3, VOCAB, (SEQ,), generator=g)), "labels": ids.clone()}
            for _ in range(32)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=BATCH, max_steps=2,
                             learning_rate=1e-3, report_to=[], use_cpu=True, save_strategy="no",
                             logging_strategy="no", disable_tqdm=True, **kw)
    return (cls or Trainer)(model=build_model("tiny_llama", device="cpu"), args=args, train_dataset=data)


def _peak(trainer) -> int:
    wrapped = memopt.wrap(trainer, budget="8GB", hardware="h200",
                          pins={"precision": "fp32", "micro_batch_size": BATCH, "checkpointing": "none"})
    return wrapped.memopt_plan.prediction["peak_allocated_bytes"]


def test_label_smoothing_is_planned_from_the_trainers_own_loss(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMOPT_CACHE_DIR", str(tmp_path / "cache"))  # the plain plan's traces are cached first
    plain = _trainer(tmp_path / "a")
    assert trainer_loss(plain) is None  # the model's own loss: nothing to add to the profile's key
    smoothed = _trainer(tmp_path / "b", label_smoothing_factor=0.1)
    assert trainer_loss(smoothed) is not None
    logits_bytes = BATCH * SEQ * VOCAB * 4
    # the smoother's log-softmax of the logits is held while the loss is made
    assert _peak(smoothed) >= _peak(plain) + logits_bytes // 2
    assert smoothed.train().training_loss > 0


def test_a_subclass_compute_loss_is_traced(tmp_path):
    from transformers import Trainer

    class KeepsFp32Copies(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = model(input_ids=inputs["input_ids"])
            logits = out.logits.float() * 1.0  # two more logits-sized tensors
            shifted = logits[:, :-1].reshape(-1, logits.shape[-1]).contiguous()
            loss = torch.nn.functional.cross_entropy(shifted, inputs["labels"][:, 1:].reshape(-1))
            return (loss, out) if return_outputs else loss

    custom = _trainer(tmp_path / "c", cls=KeepsFp32Copies)
    assert _peak(custom) > _peak(_trainer(tmp_path / "d")) + BATCH * SEQ * VOCAB * 4 // 2


def test_evaluation_inside_the_run_is_kept_within_the_plan(tmp_path):
    """An evaluation batch larger than the plan's micro-batch is capped to it, and predictions leave the GPU after
    each batch; evaluation runs and reports its loss."""
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": (ids := torch.randint(3, VOCAB, (SEQ,), generator=g)), "labels": ids.clone()}
            for _ in range(32)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=BATCH, max_steps=2,
                             per_device_eval_batch_size=64, eval_strategy="steps", eval_steps=1, learning_rate=1e-3,
                             report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
                             disable_tqdm=True)
    trainer = Trainer(model=build_model("tiny_llama", device="cpu"), args=args, train_dataset=data,
                      eval_dataset=data[:16])
    wrapped = memopt.wrap(trainer, budget="8GB", hardware="h200", pins={"micro_batch_size": 2})
    assert wrapped.args.per_device_eval_batch_size == 2 and wrapped.args.eval_accumulation_steps == 1
    assert any("evaluation batch 64 per device capped" in n for n in wrapped.memopt_plan.notes)
    wrapped.train()
    assert wrapped.evaluate()["eval_loss"] > 0
    plain = _trainer(tmp_path / "plain")  # no evaluation: its arguments are left alone
    wrapped = memopt.wrap(plain, budget="8GB", hardware="h200", pins={"micro_batch_size": 2})
    assert wrapped.args.per_device_eval_batch_size == 8 and wrapped.args.eval_accumulation_steps is None
