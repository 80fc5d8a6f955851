"""Which task a Hugging Face model is trained for comes from transformers' auto-model mappings, not from
class-name suffixes (GPT2LMHeadModel is a causal LM; classification heads are recognised)."""

import pytest
import torch
import transformers as T

import memopt
from memopt.models.hf_task import hf_task, is_causal_lm
from memopt.profile.batch_factories import spec_from_module

BERT = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
GPT2 = dict(vocab_size=64, n_embd=32, n_layer=2, n_head=2, pad_token_id=0)


@pytest.mark.parametrize("build, task", [
    (lambda: T.GPT2LMHeadModel(T.GPT2Config(**GPT2)), "causal_lm"),
    (lambda: T.BertForMaskedLM(T.BertConfig(**BERT)), "masked_lm"),
    (lambda: T.BartForConditionalGeneration(T.BartConfig(vocab_size=64, d_model=32, encoder_layers=1,
                                                         decoder_layers=1, encoder_attention_heads=2,
                                                         decoder_attention_heads=2, encoder_ffn_dim=32,
                                                         decoder_ffn_dim=32)), "seq2seq_lm"),
    (lambda: T.BertForSequenceClassification(T.BertConfig(**BERT, num_labels=3)), "sequence_classification"),
    (lambda: T.GPT2ForTokenClassification(T.GPT2Config(**GPT2, num_labels=5)), "token_classification"),
    (lambda: T.BertModel(T.BertConfig(**BERT)), None),
    (lambda: torch.nn.Linear(2, 2), None),
])
def test_task_from_the_auto_mappings(build, task):
    assert hf_task(build()) == task


def test_a_subclass_keeps_its_task():
    class MyGPT2(T.GPT2LMHeadModel):
        pass

    model = MyGPT2(T.GPT2Config(**GPT2))
    assert is_causal_lm(model) and spec_from_module(model).family == "causal_lm"


@pytest.mark.parametrize("build, family", [
    (lambda: T.GPT2LMHeadModel(T.GPT2Config(**GPT2)), "causal_lm"),
    (lambda: T.BertForSequenceClassification(T.BertConfig(**BERT, num_labels=3)), "sequence_classification"),
    (lambda: T.GPT2ForTokenClassification(T.GPT2Config(**GPT2, num_labels=5)), "token_classification"),
], ids=["gpt2_lm_head", "bert_seq_cls", "gpt2_token_cls"])
def test_shape_samples_work_for_models_recognised_by_their_mapping(build, family):
    model = build()
    prof = memopt.profile(model, {"batch_size": 2, "seq_len": 8}, hardware="h200", use_cache=False)
    assert prof.family == family
    plan = memopt.plan(model, {"batch_size": 2, "seq_len": 8}, budget="10GB", hardware="h200")
    assert plan.total_bytes > 0


def test_the_causal_label_shift_is_applied_to_gpt2_lm_head_model():
    from memopt.step.prepare import prepare
    from memopt.strategy import Strategy

    model = T.GPT2LMHeadModel(T.GPT2Config(**GPT2))
    prepared = prepare(model, Strategy(precision="fp32", optimizer="sgd"), device_type="cpu")
    try:
        assert prepared.step.causal_lm
    finally:
        prepared.undo()


def test_shape_samples_for_a_model_that_is_no_known_task_say_what_to_pass():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, labels):
            return {"loss": torch.nn.functional.mse_loss(self.lin(x), labels)}

    with pytest.raises(ValueError, match="pass a real batch"):
        memopt.profile(Net(), {"batch_size": 2, "seq_len": 8}, hardware="h200", use_cache=False)
