"""memopt.wrap(trainer) trains each optimizer step on the rows the plain Trainer's step trains on, and takes as many
steps: a dataset that is no multiple of the batch, dataloader_drop_last on and off, several epochs or max_steps, the
process's batch split inside training_step or the plan's micro-batch as the loader's batch. Compared with the plain
Trainer, same seed and shuffled order: steps, per-step losses and the trained parameters."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import memopt
from memopt.integrations.hf_trainer import wrap_trainer
from memopt.models import build_model

SEQ = 16


def _trainer(tmp_path, *, rows: int, drop_last: bool, epochs: int = 2, max_steps: int = -1):
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = build_model("tiny_llama", device="cpu")
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids.clone()} for ids in torch.randint(3, 256, (rows, SEQ), generator=g)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             num_train_epochs=epochs, max_steps=max_steps, dataloader_drop_last=drop_last,
                             learning_rate=1e-2, lr_scheduler_type="linear", optim="sgd", report_to=[],
                             use_cpu=True, save_strategy="no", logging_steps=1, seed=0, data_seed=0,
                             disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=data)


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize(("rows", "drop_last", "epochs", "max_steps", "steps", "recover"), [
    (22, True, 2, -1, 6, True),    # 20 rows an epoch in windows of 8, 8, 4: not 16 rows in two steps of 8
    (23, True, 2, 7, 7, True),     # max_steps past two epochs: 3 steps each, the last one on 4 rows
    (22, True, 2, -1, 6, False),   # the plan's micro-batch of 2 as the loader's batch, 4 accumulated
    (22, False, 2, -1, 6, True),   # nothing dropped: the last window holds 6 rows
])
def test_each_step_trains_on_the_plain_trainers_rows(tmp_path, rows, drop_last, epochs, max_steps, steps, recover):
    plain = _trainer(tmp_path / "a", rows=rows, drop_last=drop_last, epochs=epochs, max_steps=max_steps)
    plain.train()
    assert plain.state.global_step == steps
    trainer = _trainer(tmp_path / "b", rows=rows, drop_last=drop_last, epochs=epochs, max_steps=max_steps)
    kw = {"budget": "4GB", "hardware": "h200", "pins": {"micro_batch_size": 2, "precision": "fp32", "optimizer": "sgd"}}
    # without recovery (memopt.integrations.hf_trainer's recover=False) the Trainer accumulates the micro-batches
    wrapped = memopt.wrap(trainer, **kw) if recover else wrap_trainer(trainer, recover=False, **kw)
    assert wrapped.args.per_device_train_batch_size == (8 if recover else 2)
    wrapped.train()
    assert wrapped.state.global_step == steps
    assert _losses(wrapped) == pytest.approx(_losses(plain), rel=1e-5)
    for k, v in plain.model.named_parameters():
        torch.testing.assert_close(wrapped.model.get_parameter(k), v, rtol=1e-4, atol=1e-6, msg=k)
