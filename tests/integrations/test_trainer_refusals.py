"""memopt.wrap(trainer) refuses what a Trainer cannot take from it, in one line naming where the script sets it: the
loop's own arguments (optimizer, lr, loss_fn, max_grad_norm, ...) and precisions the Trainer's loop cannot run (bf16
weights with fp32 masters, pure bf16)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import memopt
from memopt.models import build_model


def _trainer(path):
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    data = [{"input_ids": (ids := torch.randint(3, 256, (16,))), "labels": ids.clone()} for _ in range(8)]
    args = TrainingArguments(output_dir=str(path), per_device_train_batch_size=4, max_steps=2, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True)
    return Trainer(model=build_model("tiny_llama", device="cpu"), args=args, train_dataset=data)


@pytest.mark.parametrize(("given", "where"), [
    ({"optimizer": "sgd"}, r"optimizer: TrainingArguments\(optim=...\)"),
    ({"lr": 0.5}, r"lr: TrainingArguments\(learning_rate=...\)"),
    ({"loss_fn": lambda out, batch: out.loss}, r"loss_fn: Trainer\(compute_loss_func=...\)"),
    ({"max_grad_norm": 1.0, "loss_reduction": "sum"}, r"max_grad_norm, loss_reduction: the Trainer runs its own loop"),
])
def test_arguments_the_trainer_takes_from_its_script_are_refused(tmp_path, given, where):
    trainer = _trainer(tmp_path)
    before = trainer.args.to_dict()
    with pytest.raises(ValueError, match=r"^memopt.wrap\(trainer\) does not take .*" + where):
        memopt.wrap(trainer, budget="4GB", hardware="h100_80gb", **given)
    assert trainer.args.to_dict() == before  # nothing was set


@pytest.mark.parametrize("precision", ["bf16_master", "bf16_pure"])
def test_a_precision_the_trainers_loop_cannot_run_is_refused_and_never_planned(tmp_path, precision):
    with pytest.raises(ValueError, match=rf"pin precision='{precision}' cannot run under a Trainer.*pin one of fp32, "
                                         "bf16_autocast, fp16_autocast"):
        memopt.wrap(_trainer(tmp_path / "a"), budget="4GB", hardware="h100_80gb", pins={"precision": precision})
    plan = memopt.wrap(_trainer(tmp_path / "b"), budget="4GB", hardware="h100_80gb", fidelity="mixed").memopt_plan
    assert plan.strategy.precision in ("fp32", "bf16_autocast", "fp16_autocast")
    assert {"bf16_master", "bf16_pure"} <= set(plan.policy["forbid"]["precision"])


def test_a_wrapped_trainer_is_not_wrapped_again(tmp_path):
    trainer = memopt.wrap(_trainer(tmp_path), budget="4GB", hardware="h100_80gb")
    with pytest.raises(ValueError, match=r"^this Trainer is already wrapped by memopt.wrap"):
        memopt.wrap(trainer, budget="4GB", hardware="h100_80gb")


def test_a_streamed_dataset_without_a_length_asks_for_the_longest_row(tmp_path):
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            for _ in range(16):
                ids = torch.randint(3, 256, (16,))
                yield {"input_ids": ids, "labels": ids.clone()}

    trainer = _trainer(tmp_path)
    trainer.train_dataset = Stream()
    with pytest.raises(ValueError, match=r"train_dataset \(Stream\) has no length .* pass sample=\{'seq_len'"):
        memopt.wrap(trainer, budget="4GB", hardware="h100_80gb")
    planned = memopt.wrap(trainer, budget="4GB", hardware="h100_80gb", sample={"seq_len": 16})
    assert planned.memopt_plan.model["sample"]["seq_len"] == 16
