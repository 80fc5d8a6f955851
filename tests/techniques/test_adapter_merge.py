"""What memopt's adapters leave behind: ``unwrap()`` gives back a model holding what the adapters trained (merged into
the weights: exactly on a full-precision base, into the kept full-precision originals with a warning on a quantized
one), and a classifier's fresh task head trains beside the adapters as peft's task types train it."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as T

import memopt
from memopt.models import SampleSpec, build_model, load_model_spec, make_batch
from memopt.step.prepare import prepare
from memopt.strategy import Strategy
from memopt.techniques.adapter_merge import task_heads
from memopt.techniques.adapters import AdapterSetting, adapter_state_dict, apply_adapters, load_adapter_state_dict
from tests.reference_loop import losses_of_plain_loop

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.filterwarnings("ignore:Paged optimizers are not supported on CPU")
LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
BERT = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)


def _lm_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 64, (8, 12), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


@torch.no_grad()
def _logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    was = model.training
    model.eval()
    out = model(input_ids=batch["input_ids"]).logits
    model.train(was)
    return out


def test_unwrap_after_lora_keeps_what_the_adapters_trained():
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(**LLAMA))
    batch = _lm_batch()
    before = _logits(model, batch)
    w = memopt.wrap(model, budget="16GB", sample=batch, hardware="h100_80gb", device="cpu", use_cache=False,
                    fidelity="lora", pins={"adapter_rank": 4, "precision": "fp32"}, lr=1e-2)
    assert w.plan.strategy.extra("adapters") is not None
    for _ in range(4):
        w.step(batch)
    trained = _logits(w.model, batch)
    assert not torch.allclose(trained, before, atol=1e-3)
    unwrapped = w.unwrap()
    assert not any("lora_" in n for n, _ in unwrapped.named_parameters())
    torch.testing.assert_close(_logits(unwrapped, batch), trained, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_the_undo_merges_each_adapter_into_its_weight(kind):
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(**LLAMA))
    batch = _lm_batch()
    _, undo = apply_adapters(model, AdapterSetting(kind=kind, r=4, alpha=8))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "magnitude" in name:
                p.add_(torch.randn_like(p) * 0.1)  # adapters that change the output
    adapted = _logits(model, batch)
    undo()
    assert all(type(m).__module__.startswith(("torch.", "transformers.")) for m in model.modules())
    torch.testing.assert_close(_logits(model, batch), adapted, rtol=1e-5, atol=1e-5)


def test_unwrap_after_qlora_merges_into_the_full_precision_weights_and_says_the_outputs_move():
    pytest.importorskip("bitsandbytes")
    from memopt.techniques.quantization import qlora

    spec = load_model_spec("tiny_llama")
    torch.manual_seed(0)
    model = build_model("tiny_llama", device="cpu")
    pristine = copy.deepcopy(model)
    batch = make_batch(spec, SampleSpec.parse({"batch_size": 2, "seq_len": 16}, spec), device="cpu")
    strategy = qlora(Strategy(), r=4, optimizer="adamw")
    prepared = prepare(model, strategy, device_type="cpu", optimizer_kwargs={"lr": 1e-2})
    for _ in range(3):
        prepared.step.step(batch)
    saved = adapter_state_dict(model)
    with pytest.warns(UserWarning, match=r"merged into their full-precision weights.* quantization error"):
        prepared.undo()
    # the merge equals the full-precision base with the trained adapters on it
    _, undo = apply_adapters(pristine, strategy.extra("adapters"))
    load_adapter_state_dict(pristine, saved)
    want = _logits(pristine, batch)
    undo()
    torch.testing.assert_close(_logits(model, batch), want, rtol=1e-4, atol=1e-4)


def _classifier() -> torch.nn.Module:
    torch.manual_seed(0)
    return T.BertForSequenceClassification(T.BertConfig(**BERT))


def _cls_batches(n: int = 3) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(3, 64, (8, 12), generator=g), "labels": torch.randint(0, 3, (8,), generator=g)}
            for _ in range(n)]


def test_a_classifiers_head_trains_beside_the_adapters_as_under_peft_seq_cls():
    """memopt's LoRA on a sequence classifier trains as peft's ``task_type=SEQ_CLS`` model with the same adapters
    (its head in ``modules_to_save``): same losses, same head, same adapters."""
    model, batches = _classifier(), _cls_batches()
    assert task_heads(model) == ["classifier"]
    w = memopt.wrap(model, budget="16GB", sample=batches[0], hardware="h100_80gb", device="cpu", use_cache=False,
                    fidelity="lora", pins={"adapter_rank": 4, "precision": "fp32", "micro_batch_size": 4},
                    optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0))
    assert any(n.startswith("the task head (classifier) trains beside the adapters") for n in w.plan.notes)
    assert {n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n} == \
        {"classifier.weight", "classifier.bias"}
    targets = [n for n, m in model.named_modules() if hasattr(m, "lora_A")]
    ref = peft.get_peft_model(_classifier(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                              task_type=peft.TaskType.SEQ_CLS))
    load_adapter_state_dict(ref, adapter_state_dict(model))  # the same initial adapters
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    want = losses_of_plain_loop(ref, batches, lambda m, b: m(**b).loss, opt)
    got = [float(w.step(b)) for b in batches]
    assert got == pytest.approx(want, rel=1e-5)
    head = ref.base_model.model.classifier.modules_to_save["default"]
    torch.testing.assert_close(model.classifier.weight, head.weight, rtol=1e-5, atol=1e-6)
    for name, value in adapter_state_dict(ref).items():
        torch.testing.assert_close(adapter_state_dict(model)[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_every_module_beside_the_backbone_is_a_task_head():
    """Heads not named classifier, score or qa_outputs are made fresh for the task too (they stayed frozen)."""
    bart = T.BartForSequenceClassification(T.BartConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
                                                         encoder_attention_heads=2, decoder_attention_heads=2,
                                                         encoder_ffn_dim=32, decoder_ffn_dim=32,
                                                         max_position_embeddings=32))
    assert task_heads(bart) == ["classification_head"]
    deberta = T.DebertaV2ForSequenceClassification(T.DebertaV2Config(vocab_size=64, hidden_size=16,
                                                                      num_hidden_layers=1, num_attention_heads=2,
                                                                      intermediate_size=32))
    assert task_heads(deberta) == ["pooler", "classifier"]
    assert task_heads(T.BertModel(T.BertConfig(**BERT))) == []  # a backbone alone has no head


def test_a_language_models_head_stays_frozen_under_adapters():
    assert task_heads(T.LlamaForCausalLM(T.LlamaConfig(**LLAMA))) == []
    assert task_heads(torch.nn.Linear(2, 2)) == []
