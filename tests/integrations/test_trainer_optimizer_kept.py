"""memopt.wrap(trainer) keeps the optimizer the script chose: its ``optim`` argument (SGD, Adafactor), an
optimizer handed to the Trainer, or an 8-bit AdamW where the fidelity allows it. Training equals the plain Trainer's;
an AdamW the Trainer builds leaves memopt the choice among its AdamW implementations."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")

import memopt
from memopt.models import build_model

SEQ = 16
STEPS = 3


def _data(n: int = 24):
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": (ids := torch.randint(3, 256, (SEQ,), generator=g)), "labels": ids.clone()}
            for _ in range(n)]


def _trainer(path, *, optim: str = "adamw_torch", optimizer=None):
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = build_model("tiny_llama", device="cpu")
    args = TrainingArguments(output_dir=str(path), per_device_train_batch_size=4, max_steps=STEPS,
                             learning_rate=1e-2, lr_scheduler_type="constant", optim=optim, report_to=[],
                             use_cpu=True, save_strategy="no", logging_steps=1, seed=0, data_seed=0, disable_tqdm=True)
    optimizers = (optimizer(model), None) if optimizer is not None else (None, None)
    return Trainer(model=model, args=args, train_dataset=_data(), optimizers=optimizers)


def _losses(trainer) -> list[float]:
    return [r["loss"] for r in trainer.state.log_history if "loss" in r]


def _same_training(tmp_path, **script) -> object:
    plain = _trainer(tmp_path / "plain", **script)
    plain.train()
    wrapped = memopt.wrap(_trainer(tmp_path / "memopt", **script), budget="4GB", hardware="h100_80gb",
                          fidelity="exact", pins={"micro_batch_size": 2})
    wrapped.train()
    inner = getattr(wrapped.optimizer, "optimizer", wrapped.optimizer)
    assert type(inner) is type(getattr(plain.optimizer, "optimizer", plain.optimizer))
    assert len(_losses(wrapped)) == STEPS and _losses(wrapped) == pytest.approx(_losses(plain), rel=1e-5)
    for name, value in plain.model.named_parameters():
        torch.testing.assert_close(wrapped.model.get_parameter(name), value, rtol=1e-5, atol=1e-6)
    return wrapped


@pytest.mark.parametrize("optim", ["sgd", "adafactor"])
def test_the_scripts_optim_is_kept_and_trains_as_the_plain_trainer(tmp_path, optim):
    wrapped = _same_training(tmp_path, optim=optim)
    assert str(getattr(wrapped.args.optim, "value", wrapped.args.optim)) == optim
    if optim != "sgd":  # no memopt variant: planned as the user's own optimizer, its states traced
        assert wrapped.memopt_plan.strategy.optimizer == "user"
        assert any(f"optim='{optim}') is kept" in n for n in wrapped.memopt_plan.notes)
    else:
        assert wrapped.memopt_plan.strategy.optimizer == "sgd"


def test_an_optimizer_handed_to_the_trainer_is_kept(tmp_path):
    wrapped = _same_training(tmp_path, optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.5,
                                                                           nesterov=True))
    assert wrapped.memopt_plan.strategy.optimizer == "user"
    assert any("(SGD) is kept" in n for n in wrapped.memopt_plan.notes)


def test_the_trainers_adamw_leaves_memopt_the_implementation(tmp_path):
    wrapped = memopt.wrap(_trainer(tmp_path, optim="adamw_torch"), budget="4GB", hardware="h100_80gb")
    assert wrapped.memopt_plan.strategy.optimizer in ("adamw_fused", "adamw_foreach", "adamw")


def test_an_8bit_adamw_is_pinned_where_the_fidelity_allows_it_and_warned_about_where_not(tmp_path):
    pytest.importorskip("bitsandbytes")
    allowed = memopt.wrap(_trainer(tmp_path / "a", optim="adamw_bnb_8bit"), budget="4GB", hardware="h100_80gb",
                          fidelity="8bit")
    assert allowed.memopt_plan.strategy.optimizer == "adamw8bit"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        refused = memopt.wrap(_trainer(tmp_path / "b", optim="adamw_bnb_8bit"), budget="4GB", hardware="h100_80gb",
                              fidelity="exact")
    assert refused.memopt_plan.strategy.optimizer != "adamw8bit"
    assert any("optim='adamw_bnb_8bit'" in str(w.message) and "fidelity='8bit' keeps the script's" in str(w.message)
               for w in caught)
