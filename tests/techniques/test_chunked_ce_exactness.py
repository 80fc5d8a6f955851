"""Chunked cross-entropy is offered only where it reproduces the model's own loss: heads that are more than
``hidden @ W.T`` (softcapping, logit scaling, a scaled hidden state, an extra term in the loss) are refused,
with the reason in the profile's notes, and the chunked loss equals the model's loss where it is offered."""

import pytest
import torch
import transformers as T

import memopt
from memopt.techniques.chunked_ce import causal_lm_chunked_loss, chunked_ce_refusal, supports_chunked_ce

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2)


def _gemma2(**kw):
    torch.manual_seed(0)
    return T.Gemma2ForCausalLM(T.Gemma2Config(**{**SMALL, "head_dim": 16, **kw}))


class ScaledLlama(T.LlamaForCausalLM):
    """A user's subclass that scales the logits with no config field saying so."""

    def forward(self, input_ids=None, labels=None, **kw):
        out = super().forward(input_ids=input_ids, **kw)
        logits = out.logits * 2.0
        loss = self.loss_function(logits, labels, self.config.vocab_size) if labels is not None else None
        return T.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


def _batch(vocab=96, b=2, s=12):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def test_gemma2_softcapping_is_refused_and_its_chunked_loss_would_differ():
    model = _gemma2(final_logit_softcapping=30.0)
    with torch.no_grad():
        model.lm_head.weight.mul_(200.0)  # logits of tens, where the cap bends them (as in trained models)
    batch = _batch()
    own = model(**batch).loss
    assert not supports_chunked_ce(model)
    assert "final_logit_softcapping" in chunked_ce_refusal(model)
    with pytest.raises(ValueError, match="not exact"):
        causal_lm_chunked_loss(model, batch, chunks=4)
    # what the head-only chunked loss computes: not the model's loss (why it must be refused)
    hidden = model.base_model(input_ids=batch["input_ids"]).last_hidden_state
    plain = torch.nn.functional.cross_entropy((hidden @ model.lm_head.weight.T)[:, :-1].reshape(-1, 96),
                                              batch["labels"][:, 1:].reshape(-1))
    assert abs(plain.item() - own.item()) > 1.0


@pytest.mark.parametrize("build", [
    lambda: T.CohereForCausalLM(T.CohereConfig(**SMALL)),
    lambda: T.GraniteForCausalLM(T.GraniteConfig(**SMALL, logits_scaling=8.0)),
    lambda: T.MiniCPM3ForCausalLM(T.MiniCPM3Config(**SMALL)),
], ids=["cohere_logit_scale", "granite_logits_scaling", "minicpm3_scaled_hidden"])
def test_scaled_heads_are_refused(build):
    assert chunked_ce_refusal(build()) is not None


def test_the_probe_refuses_a_transform_no_config_names():
    model = ScaledLlama(T.LlamaConfig(**SMALL))
    reason = chunked_ce_refusal(model)
    assert reason is not None and "changes the logits" in reason


@pytest.mark.parametrize("build", [
    lambda: T.LlamaForCausalLM(T.LlamaConfig(**SMALL)),
    lambda: _gemma2(final_logit_softcapping=None),
    lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                                           embd_pdrop=0.0, attn_pdrop=0.0)),
], ids=["llama", "gemma2_without_softcap", "gpt2_tied"])
def test_supported_heads_give_the_models_own_loss_and_gradients(build):
    torch.manual_seed(0)
    model = build()
    assert chunked_ce_refusal(model) is None
    batch = _batch()
    own = model(**batch).loss
    own.backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    chunked = causal_lm_chunked_loss(model, batch, chunks=3)
    chunked.backward()
    torch.testing.assert_close(chunked, own, rtol=1e-5, atol=1e-6)
    for p, g in zip(model.parameters(), ref):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)


def test_profile_of_a_softcapped_model_records_the_refusal_and_the_planner_never_chunks():
    model = _gemma2(final_logit_softcapping=30.0, vocab_size=40_000)
    prof = memopt.profile(model, {"batch_size": 2, "seq_len": 16}, hardware="h200", use_cache=False)
    assert prof.chunked_ce_refusal and "final_logit_softcapping" in prof.chunked_ce_refusal
    plan = memopt.plan(model, {"batch_size": 2, "seq_len": 16}, budget="20GB", hardware="h200")
    assert plan.strategy.chunked_ce == 0
    assert any("chunked cross-entropy refused" in n for n in plan.notes)


def test_the_probe_checks_a_grouped_gemm_mixture_of_experts_head_in_any_process():
    """transformers' grouped-GEMM experts call ``_grouped_mm`` in fp32, which PyTorch's meta function refuses:
    the head probe raised in a fresh process and chunked CE was refused for the model, while after some other
    trace in the same process it was allowed (the plan depended on what the process had planned before)."""
    from memopt.models import build_model

    torch.manual_seed(0)
    model = build_model("tiny_moe", device="meta")
    experts = next(m for m in model.modules() if type(m).__name__.endswith("Experts"))
    assert getattr(experts.config, "_experts_implementation", None) in (None, "grouped_mm")
    assert chunked_ce_refusal(model) is None
