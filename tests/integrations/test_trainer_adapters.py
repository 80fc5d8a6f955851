"""Under a Trainer memopt plans neither LoRA adapters nor a quantized base: the Trainer trains the model it was given,
with an optimizer over that model's parameters, so a plan with adapters would predict memory for a method that never
runs. The ladder stays at full fine-tuning (the plan says why), pins that ask for adapters or quantization are refused
in one line, and a Trainer whose model the script made a peft model trains as the plain Trainer does."""

from __future__ import annotations

import pytest
import torch

import memopt

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

BERT = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)


def _rows(n: int = 16) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(2, 128, (12,), generator=g), "labels": torch.tensor(i % 3)} for i in range(n)]


def _bert():
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(transformers.BertConfig(**BERT))


def _peft_bert():
    config = peft.LoraConfig(r=4, target_modules=["query", "value"], task_type=peft.TaskType.SEQ_CLS,
                             init_lora_weights=False)
    return peft.get_peft_model(_bert(), config)


def _trainer(path, model):
    args = transformers.TrainingArguments(
        output_dir=str(path), per_device_train_batch_size=8, max_steps=2, learning_rate=1e-2, report_to=[],
        use_cpu=True, save_strategy="no", logging_steps=1, seed=0, disable_tqdm=True)
    return transformers.Trainer(model=model, args=args, train_dataset=_rows())


@pytest.mark.parametrize("fidelity", ["lora", "qlora"])
def test_the_trainer_path_plans_full_fine_tuning_and_says_why(tmp_path, fidelity):
    trainer = memopt.wrap(_trainer(tmp_path, _bert()), budget="16GB", hardware="h100_80gb", fidelity=fidelity)
    plan = trainer.memopt_plan
    assert plan.strategy.extra("adapters") is None and plan.strategy.extra("quantization") is None
    assert plan.policy["pins"]["adapter_rank"] == 0 and plan.policy["pins"]["quant_bits"] == 0
    assert any(n.startswith("adapters and quantized weights refused: under a Trainer memopt adds no adapters")
               and "peft.get_peft_model" in n for n in plan.notes)


@pytest.mark.parametrize("pins", [{"adapter_rank": 4}, {"adapter_rank": 4, "quant_bits": 4}])
def test_pins_asking_for_adapters_or_quantization_under_a_trainer_are_refused_in_one_line(tmp_path, pins):
    trainer = _trainer(tmp_path, _bert())
    before = trainer.args.to_dict()
    with pytest.raises(ValueError, match=r"^pins adapter_rank=4.* cannot run under a Trainer: .*get_peft_model") as e:
        memopt.wrap(trainer, budget="16GB", hardware="h100_80gb", fidelity="qlora", pins=pins)
    assert "\n" not in str(e.value)
    assert trainer.args.to_dict() == before and getattr(trainer, "memopt_plan", None) is None


def test_a_saved_plan_with_adapters_is_refused_under_a_trainer(tmp_path):
    sample = {"input_ids": torch.randint(2, 128, (8, 12)), "labels": torch.zeros(8, dtype=torch.long)}
    plan = memopt.plan(_bert(), sample, budget="16GB", hardware="h100_80gb", fidelity="lora",
                       pins={"adapter_rank": 4}, use_cache=False)
    assert plan.strategy.extra("adapters") is not None
    with pytest.raises(ValueError, match=r"uses adapters: under a Trainer memopt adds no adapters"):
        memopt.wrap(_trainer(tmp_path, _bert()), plan=plan)


def test_a_trainer_of_a_peft_model_trains_as_the_plain_trainer(tmp_path):
    plain = _trainer(tmp_path / "plain", _peft_bert())
    plain.train()
    wrapped = memopt.wrap(_trainer(tmp_path / "memopt", _peft_bert()), budget="16GB", hardware="h100_80gb",
                          fidelity="lora", pins={"micro_batch_size": 4, "precision": "fp32"})
    wrapped.train()
    assert wrapped.memopt_plan.strategy.extra("adapters") is None
    losses = [[r["loss"] for r in t.state.log_history if "loss" in r] for t in (plain, wrapped)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    for name, value in plain.model.named_parameters():
        torch.testing.assert_close(wrapped.model.get_parameter(name), value, rtol=1e-5, atol=1e-6, msg=name)
