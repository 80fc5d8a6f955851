"""Hugging Face models are recognised by class through transformers' auto-model mappings, not by a name suffix:
GPT2LMHeadModel is a causal LM (its labels shift inside), so its micro-batches are weighted by shifted tokens."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import memopt
from memopt.models.hf_task import hf_task, is_causal_lm, is_hf_model

transformers = pytest.importorskip("transformers")


def _gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, eos_token_id=0,
                                  bos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def _bert(cls: type) -> nn.Module:
    cfg = transformers.BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=64, max_position_embeddings=16, num_labels=3)
    return cls(cfg)


def test_tasks_come_from_the_class_not_its_name():
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        num_layers=1, d_model=16, d_ff=32, num_heads=2, d_kv=8, vocab_size=64, decoder_start_token_id=0))
    assert hf_task(_gpt2()) == "causal_lm" and is_causal_lm(_gpt2())
    assert hf_task(_bert(transformers.BertForSequenceClassification)) == "sequence_classification"
    assert hf_task(_bert(transformers.BertForTokenClassification)) == "token_classification"
    assert hf_task(_bert(transformers.BertForMaskedLM)) == "masked_lm"
    assert hf_task(t5) == "seq2seq_lm"
    assert hf_task(_bert(transformers.BertModel)) is None  # a base model has no task head
    assert not is_hf_model(nn.Linear(2, 2)) and hf_task(nn.Linear(2, 2)) is None

    class MyLM(transformers.GPT2LMHeadModel):  # a user subclass keeps its parent's task
        pass

    assert hf_task(MyLM(_gpt2().config)) == "causal_lm"

    # a model whose code ships with its checkpoint (trust_remote_code) is in no mapping: its head's name says it
    class RemoteForCausalLM(transformers.GPT2PreTrainedModel):
        pass

    class RemoteModel(transformers.GPT2PreTrainedModel):
        pass

    assert hf_task(RemoteForCausalLM) == "causal_lm" and hf_task(RemoteModel) is None


def test_gpt2_micro_batches_are_weighted_by_shifted_loss_tokens():
    """Rows with many -100 labels in one micro-batch: exact only if each micro-batch counts its labels after the
    causal shift, as the model's loss does (GPT2LMHeadModel was not recognised as a causal LM by its name)."""
    torch.manual_seed(0)
    model = _gpt2()
    ref = copy.deepcopy(model)

    def batch(i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, 64, (4, 8), generator=g)
        labels = ids.clone()
        labels[:2, 2:] = -100  # micro-batch 0: 2 shifted tokens; micro-batch 1: 14
        return {"input_ids": ids, "labels": labels}

    batches = [batch(i) for i in range(3)]
    wrapped = memopt.wrap(model, budget="4GB", sample=batches[0], hardware="h100_80gb", device="cpu",
                          use_cache=False, pins={"micro_batch_size": 2, "precision": "fp32", "checkpointing": "none"},
                          optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5))
    got = [wrapped.step(b) for b in batches]
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    want = []
    for b in batches:
        loss = ref(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(float(loss.detach()))
    assert got == pytest.approx(want, rel=1e-5)
    for p, q in zip(wrapped.model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
