"""A model's own loss under a split batch, through ``memopt.wrap(trainer)`` and ``memopt.wrap(model)``: the loss of a
task head is split exactly, even where the Trainer divides it by a count of its own (GPT-2: every label, unshifted);
a loss over in-batch negatives (CLIP) or with a router's load-balancing term over the whole batch (Mixtral with
``output_router_logits``) is measured at the first split batch and refused before anything trains."""

from __future__ import annotations

import pytest
import torch

import memopt
from memopt.step.loss_reduction import LossNotSplittable, own_loss_unknown

transformers = pytest.importorskip("transformers")

STEPS = 3


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))


def _mixtral(router_logits: bool):
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, num_local_experts=4, num_experts_per_tok=2, output_router_logits=router_logits,
        router_aux_loss_coef=0.5))


def _clip():
    return transformers.CLIPModel(transformers.CLIPConfig(
        text_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                     "vocab_size": 128, "max_position_embeddings": 16},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": 16, "patch_size": 8}, projection_dim=16))


def _lm_rows(n: int = 16, seq: int = 12) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": (ids := torch.randint(3, 128, (seq,), generator=g)), "labels": ids.clone()}
            for _ in range(n)]


def _trainer(path, make, rows, collator=None):
    torch.manual_seed(0)
    model = make()
    args = transformers.TrainingArguments(
        output_dir=str(path), per_device_train_batch_size=4, max_steps=STEPS, learning_rate=0.5, optim="sgd",
        lr_scheduler_type="constant", report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, seed=0,
        data_seed=0, disable_tqdm=True, max_grad_norm=0.0, remove_unused_columns=False)
    return transformers.Trainer(model=model, args=args, train_dataset=rows, data_collator=collator)


def _losses(trainer) -> list[float]:
    return [r["loss"] for r in trainer.state.log_history if "loss" in r]


def test_gpt2_under_the_trainer_trains_as_the_plain_trainer_when_the_batch_is_split(tmp_path):
    """The Trainer divides GPT-2's summed loss by every label of the batch (not by the shifted ones): each
    micro-batch keeps that count, so the split equals the plain Trainer (it was 12/11 of it, with SGD's gradients
    as far off)."""
    plain = _trainer(tmp_path / "plain", _gpt2, _lm_rows())
    plain.train()
    wrapped = memopt.wrap(_trainer(tmp_path / "memopt", _gpt2, _lm_rows()), budget="4GB", hardware="h100_80gb",
                          fidelity="exact", pins={"micro_batch_size": 2})
    wrapped.train()
    assert wrapped.memopt_plan.strategy.micro_batch_size == 2
    assert _losses(wrapped) == pytest.approx(_losses(plain), rel=1e-5)
    for name, value in plain.model.named_parameters():
        torch.testing.assert_close(wrapped.model.get_parameter(name), value, rtol=1e-5, atol=1e-6)


def _clip_rows(n: int = 16) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(3, 128, (8,), generator=g), "pixel_values": torch.randn(3, 16, 16, generator=g)}
            for _ in range(n)]


def _clip_collator(rows):
    return {"input_ids": torch.stack([r["input_ids"] for r in rows]),
            "pixel_values": torch.stack([r["pixel_values"] for r in rows]), "return_loss": True}


@pytest.mark.parametrize("case", ["clip", "mixtral"])
def test_a_loss_micro_batches_cannot_reproduce_is_refused_before_the_trainer_trains(tmp_path, case):
    make, rows, collator = ((_clip, _clip_rows(), _clip_collator) if case == "clip"
                            else (lambda: _mixtral(True), _lm_rows(), None))
    trainer = memopt.wrap(_trainer(tmp_path, make, rows, collator), budget="4GB", hardware="h100_80gb",
                          fidelity="exact", pins={"micro_batch_size": 2})
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(LossNotSplittable, match=r"cannot be split into the plan's micro-batches of 2"):
        trainer.train()
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_wrap_of_a_model_measures_an_own_loss_it_does_not_know():
    assert own_loss_unknown(_gpt2()) is None and own_loss_unknown(_mixtral(False)) is None
    assert "router" in own_loss_unknown(_mixtral(True))
    assert "CLIPModel" in own_loss_unknown(_clip())
    torch.manual_seed(0)
    batch = _clip_collator(_clip_rows(8))
    w = memopt.wrap(_clip(), budget="4GB", sample=batch, hardware="h100_80gb", guard=False,
                    pins={"micro_batch_size": 2, "precision": "fp32"})
    with pytest.raises(LossNotSplittable, match=r"given twice"):
        w.step(batch)
    assert w.steps_done == 0
