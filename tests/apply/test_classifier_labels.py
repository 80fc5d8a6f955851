"""A classifier's labels keep what they hold through planning: float 0/1 labels with a column per class
(multi-label classification) stay float ``(batch, num_labels)``, float regression targets stay float, where the
batches the profile makes used to be class ids (and 2-d labels were taken for per-token ones). memopt.wrap(model),
memopt.plan and memopt.wrap(trainer) train as the unwrapped loop."""

from __future__ import annotations

import copy

import pytest
import torch

import memopt
from tests.reference_loop import losses_of_plain_loop

transformers = pytest.importorskip("transformers")

B, SEQ, LABELS = 8, 12, 4


def _bert(num_labels: int = LABELS, problem_type: str | None = "multi_label_classification"):
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=num_labels,
        problem_type=problem_type))


def _vit():
    torch.manual_seed(0)
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=16, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=LABELS,
        problem_type="multi_label_classification"))


def _labels(g: torch.Generator, shape: tuple[int, ...], kind: str) -> torch.Tensor:
    return (torch.rand(shape, generator=g) > 0.5).float() if kind == "multi_label" else torch.randn(shape, generator=g)


def _token_batches(kind: str = "multi_label", shape: tuple[int, ...] = (B, LABELS), n: int = 3) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(2, 64, (B, SEQ), generator=g), "labels": _labels(g, shape, kind)}
            for _ in range(n)]


def _image_batches(n: int = 3) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"pixel_values": torch.randn(B, 3, 16, 16, generator=g), "labels": _labels(g, (B, LABELS), "multi_label")}
            for _ in range(n)]


def _assert_trains_as_the_plain_loop(model, batches, micro: int) -> memopt.Wrapped:
    ref = copy.deepcopy(model)
    # SGD: Adam would magnify the fp32 noise of near-zero gradients
    want = losses_of_plain_loop(ref, batches, lambda m, b: m(**b).loss,
                                torch.optim.SGD(ref.parameters(), lr=0.1))
    w = memopt.wrap(model, budget="4GB", sample=batches[0], hardware="h100_80gb", device="cpu", use_cache=False,
                    guard=False, optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                    pins={"micro_batch_size": micro, "precision": "fp32"})
    got = [w.step(b) for b in batches]
    assert got == pytest.approx(want, rel=1e-5)
    for name, value in ref.named_parameters():
        torch.testing.assert_close(model.get_parameter(name), value, rtol=1e-5, atol=1e-6, msg=name)
    return w


@pytest.mark.parametrize("micro", [B, 2])
def test_a_multi_label_bert_trains_as_the_plain_loop(micro):
    w = _assert_trains_as_the_plain_loop(_bert(), _token_batches(), micro)
    assert w.plan.model["sample"]["label_kind"] == "multi_label"


def test_float_labels_make_a_multi_label_bert_without_a_problem_type():
    """transformers takes float labels for multi-label ones where the config names no problem_type: so does the
    plan (at 4 tokens a row, as many as labels, where the labels were taken for per-token ones)."""
    model = _bert(problem_type=None)
    w = _assert_trains_as_the_plain_loop(
        model, [{**b, "input_ids": b["input_ids"][:, :LABELS]} for b in _token_batches()], 2)
    assert w.plan.model["sample"]["label_kind"] == "multi_label"


@pytest.mark.parametrize("shape", [(B,), (B, 1)])
def test_regression_targets_stay_float(shape):
    w = _assert_trains_as_the_plain_loop(_bert(num_labels=1, problem_type=None), _token_batches("regression", shape),
                                         2)
    assert w.plan.model["sample"]["label_kind"] == "regression"


@pytest.mark.parametrize("micro", [B, 2])
def test_a_multi_label_vit_trains_as_the_plain_loop(micro):
    _assert_trains_as_the_plain_loop(_vit(), _image_batches(), micro)


def test_plan_makes_multi_label_batches_from_shapes_and_from_a_batch():
    """From shapes alone the labels come from the config's problem_type; from a batch, from the batch."""
    for sample in ({"batch_size": B, "seq_len": SEQ}, _token_batches(n=1)[0]):
        plan = memopt.plan(_bert(), sample, budget="4GB", hardware="h100_80gb")
        assert plan.fits
    assert memopt.plan(_vit(), {"batch_size": B, "image_size": 16}, budget="4GB", hardware="h100_80gb").fits


def test_a_multi_label_trainer_trains_as_the_plain_trainer(tmp_path):
    rows = [{"input_ids": b["input_ids"][i], "labels": b["labels"][i]} for b in _token_batches(n=2) for i in range(B)]

    def trainer(path):
        args = transformers.TrainingArguments(
            output_dir=str(path), per_device_train_batch_size=B, max_steps=2, learning_rate=0.1, optim="sgd",
            report_to=[], lr_scheduler_type="constant", use_cpu=True, save_strategy="no", logging_steps=1, seed=0,
            data_seed=0, disable_tqdm=True)
        return transformers.Trainer(model=_bert(), args=args, train_dataset=rows)

    plain = trainer(tmp_path / "plain")
    plain.train()
    wrapped = memopt.wrap(trainer(tmp_path / "memopt"), budget="4GB", hardware="h100_80gb", fidelity="exact",
                          pins={"micro_batch_size": 2})
    wrapped.train()
    losses = [[r["loss"] for r in t.state.log_history if "loss" in r] for t in (wrapped, plain)]
    assert len(losses[0]) == 2 and losses[0] == pytest.approx(losses[1], rel=1e-5)
    for name, value in plain.model.named_parameters():
        torch.testing.assert_close(wrapped.model.get_parameter(name), value, rtol=1e-5, atol=1e-6, msg=name)
