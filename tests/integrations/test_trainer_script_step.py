"""A Trainer whose step or loss is the script's, under ``memopt.wrap(trainer)``, against the plain Trainer on the same
seed and data: a ``training_step`` of a subclass runs on the script's own batches (memopt cannot split a step that
backpropagates terms of its own), and a loss of the script's that ignores ``num_items_in_batch`` on a causal LM
(whose forward takes it) is measured as a mean and weighted, not summed over the micro-batches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import memopt

transformers = pytest.importorskip("transformers")

STEPS = 3


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32))


def _rows(n: int = 16, seq: int = 12) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": (ids := torch.randint(3, 128, (seq,), generator=g)), "labels": ids.clone(),
             "attention_mask": torch.ones(seq, dtype=torch.long)} for _ in range(n)]


class ModelLossStep(transformers.Trainer):
    """The step many scripts copied: the model's mean loss, backward, detach."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        loss = model(**self._prepare_inputs(inputs)).loss
        self.accelerator.backward(loss)
        return loss.detach()


class PenaltyStep(transformers.Trainer):
    """The Trainer's step, then a weight penalty backpropagated by the script itself."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        penalty = 1e-2 * sum((p ** 2).sum() for p in model.parameters())
        self.accelerator.backward(penalty)
        return loss + penalty.detach()


class MeanLoss(transformers.Trainer):
    """The most common ``compute_loss`` override: the model's own mean, ``num_items_in_batch`` ignored."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=inputs["labels"])
        return (out.loss, out) if return_outputs else out.loss


class ItemsLoss(transformers.Trainer):
    """A loss summed over the tokens and divided by ``num_items_in_batch`` (the mean where none is given)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        out = model(**inputs)
        logits, targets = out.logits[:, :-1].float(), labels[:, 1:]
        total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
        loss = total / (num_items_in_batch if num_items_in_batch is not None else targets.numel())
        return (loss, out) if return_outputs else loss


def _smoothed_mean(outputs, labels, num_items_in_batch=None):
    logits, targets = outputs.logits[:, :-1].float(), labels[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), label_smoothing=0.1)


def _trainer(path, cls=transformers.Trainer, per_device=4, accumulation=1, **extra):
    torch.manual_seed(0)
    args = transformers.TrainingArguments(
        output_dir=str(path), per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation,
        max_steps=STEPS, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", report_to=[], use_cpu=True,
        save_strategy="no", logging_steps=1, seed=0, data_seed=0, disable_tqdm=True, max_grad_norm=0.0)
    return cls(model=_llama(), args=args, train_dataset=_rows(), **extra)


def _losses(trainer) -> list[float]:
    return [r["loss"] for r in trainer.state.log_history if "loss" in r]


def _same_training(plain, wrapped) -> None:
    assert _losses(wrapped) == pytest.approx(_losses(plain), rel=1e-5)
    for name, value in plain.model.named_parameters():
        torch.testing.assert_close(wrapped.model.get_parameter(name), value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", [ModelLossStep, PenaltyStep])
def test_a_script_training_step_runs_on_the_script_batches(tmp_path, cls):
    """Run once per micro-batch, the script's step gave N x the loss and the gradient (the penalty counted N times):
    memopt now keeps the script's per-device batch and accumulation, and the training is the plain Trainer's."""
    plain = _trainer(tmp_path / "plain", cls, per_device=2, accumulation=2)
    plain.train()
    wrapped = memopt.wrap(_trainer(tmp_path / "memopt", cls, per_device=2, accumulation=2), budget="4GB",
                          hardware="h100_80gb", fidelity="exact")
    assert (wrapped.args.per_device_train_batch_size, wrapped.args.gradient_accumulation_steps) == (2, 2)
    assert wrapped.memopt_plan.strategy.micro_batch_size == 2
    assert any(f"{cls.__name__}.training_step" in note for note in wrapped.memopt_plan.notes)
    wrapped.train()
    _same_training(plain, wrapped)


def test_a_pin_that_would_split_a_script_training_step_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"ModelLossStep\.training_step, which memopt cannot split"):
        memopt.wrap(_trainer(tmp_path, ModelLossStep), budget="4GB", hardware="h100_80gb", fidelity="exact",
                    pins={"micro_batch_size": 2})


@pytest.mark.parametrize("case", ["override_mean", "loss_func_mean", "override_num_items"])
def test_a_script_loss_is_measured_for_num_items_on_a_causal_lm(tmp_path, case):
    """A causal LM's forward takes loss kwargs, so memopt took the script's loss to divide by
    ``num_items_in_batch`` and summed the micro-batches' means: 4 x the loss at micro-batch 1 of 4. Whether it
    does is measured now; a loss that does divide is still added unweighted."""
    extra = {"compute_loss_func": _smoothed_mean} if case == "loss_func_mean" else {}
    cls = {"override_mean": MeanLoss, "override_num_items": ItemsLoss}.get(case, transformers.Trainer)
    plain = _trainer(tmp_path / "plain", cls, **extra)
    plain.train()
    wrapped = memopt.wrap(_trainer(tmp_path / "memopt", cls, **extra), budget="4GB", hardware="h100_80gb",
                          fidelity="exact", pins={"micro_batch_size": 1})
    wrapped.train()
    assert wrapped.memopt_plan.strategy.micro_batch_size == 1
    _same_training(plain, wrapped)
