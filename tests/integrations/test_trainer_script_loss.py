"""A Trainer subclass's own ``compute_loss`` under a split batch: measured at the first split batch as
``memopt.wrap(model)`` measures a user's loss. A sum over the samples is accumulated unweighted and trains as the plain
Trainer; a mean weighted by a column of the batch, which no weighting of micro-batches reproduces, is refused before
anything trains."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import memopt
from memopt.step.loss_reduction import LossNotSplittable

transformers = pytest.importorskip("transformers")

BERT = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)


class SummedLoss(transformers.Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(input_ids=inputs["input_ids"])
        loss = F.cross_entropy(out.logits, inputs["labels"], reduction="sum")
        return (loss, out) if return_outputs else loss


class WeightedMean(transformers.Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        w = inputs.pop("weight")
        out = model(**inputs)
        loss = (F.cross_entropy(out.logits, inputs["labels"], reduction="none") * w).sum() / w.sum()
        return (loss, out) if return_outputs else loss


def _rows(weighted: bool, n: int = 16) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(2, 128, (12,), generator=g), "labels": torch.randint(0, 3, (), generator=g),
             "weight": torch.rand((), generator=g) * 3} for _ in range(n)]
    return rows if weighted else [{k: v for k, v in r.items() if k != "weight"} for r in rows]


def _trainer(path, cls, weighted: bool):
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(**BERT))
    args = transformers.TrainingArguments(
        output_dir=str(path), per_device_train_batch_size=8, max_steps=2, learning_rate=0.05, optim="sgd",
        lr_scheduler_type="constant", max_grad_norm=0.0, report_to=[], use_cpu=True, save_strategy="no",
        logging_steps=1, seed=0, data_seed=0, disable_tqdm=True, remove_unused_columns=False)
    return cls(model=model, args=args, train_dataset=_rows(weighted))


def test_a_summed_compute_loss_is_accumulated_unweighted_and_trains_as_the_plain_trainer(tmp_path):
    plain = _trainer(tmp_path / "plain", SummedLoss, False)
    plain.train()
    wrapped = memopt.wrap(_trainer(tmp_path / "memopt", SummedLoss, False), budget="4GB", hardware="h100_80gb",
                          fidelity="exact", pins={"micro_batch_size": 2})
    wrapped.train()
    assert wrapped.memopt_plan.strategy.micro_batch_size == 2
    assert any("measured as a sum" in n for n in wrapped.memopt_plan.notes)
    losses = [[r["loss"] for r in t.state.log_history if "loss" in r] for t in (plain, wrapped)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    for name, value in plain.model.named_parameters():
        torch.testing.assert_close(wrapped.model.get_parameter(name), value, rtol=1e-5, atol=1e-6, msg=name)


def test_a_compute_loss_weighted_by_a_column_is_refused_before_the_trainer_trains(tmp_path):
    trainer = memopt.wrap(_trainer(tmp_path, WeightedMean, True), budget="4GB", hardware="h100_80gb",
                          fidelity="exact", pins={"micro_batch_size": 2})
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(LossNotSplittable, match=r"^the Trainer's loss is the script's .* cannot be split into the "
                                                r"plan's micro-batches of 2: .* weighted by") as e:
        trainer.train()
    assert "\n" not in str(e.value)
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, before[k]), k
