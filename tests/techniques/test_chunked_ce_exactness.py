"""The fused losses (memopt's chunked cross-entropy, Liger's kernel through its CPU stand-in) are offered only where
they reproduce the model's own loss: a head's declared softcap (Gemma-2) and logit scale (Granite, Cohere) are
applied (Liger takes the softcap only), and a head that does more than its config says, or whose input is not the
base model's last hidden state, is refused with the reason in the profile's notes."""

import pytest
import torch
import transformers as T

import memopt
from memopt.profile.head_probe import head_refusal
from memopt.techniques.chunked_ce import causal_lm_chunked_loss
from memopt.techniques.liger_ce import liger_refusal

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


class DoubleCapGemma2(T.Gemma2ForCausalLM):
    """A user's subclass that caps its logits once more than its config says."""

    def forward(self, input_ids=None, labels=None, **kw):
        out = super().forward(input_ids=input_ids, **kw)
        logits = torch.tanh(out.logits / 30.0) * 30.0
        loss = self.loss_function(logits, labels, self.config.vocab_size) if labels is not None else None
        return T.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


def _own_and_fused(model, kernel):
    batch = _batch()
    own = model(**batch).loss
    own.backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    fused = causal_lm_chunked_loss(model, batch, chunks=3, kernel=kernel)
    fused.backward()
    return own, ref, fused, [p.grad for p in model.parameters()]


def _loud(model):
    with torch.no_grad():  # logits of tens, where a softcap bends them (as in trained models)
        model.get_output_embeddings().weight.mul_(200.0)
    return model


@pytest.mark.parametrize("kernel", ["memopt", "liger"])
def test_gemma2_softcapped_head_gives_the_models_own_loss_and_gradients(kernel):
    model = _loud(_gemma2(final_logit_softcapping=30.0))
    assert head_refusal(model) is None and liger_refusal(model, None) is None
    own, ref, fused, grads = _own_and_fused(model, kernel)
    # the head-only cross-entropy (what a fused loss without the cap computes) is far from the model's loss
    batch = _batch()
    hidden = model.base_model(input_ids=batch["input_ids"]).last_hidden_state
    plain = torch.nn.functional.cross_entropy((hidden @ model.lm_head.weight.T)[:, :-1].reshape(-1, 96),
                                              batch["labels"][:, 1:].reshape(-1))
    assert abs(plain.item() - own.item()) > 1.0
    torch.testing.assert_close(fused, own, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("build", [
    lambda: T.CohereForCausalLM(T.CohereConfig(**SMALL)),
    lambda: T.GraniteForCausalLM(T.GraniteConfig(**SMALL, logits_scaling=8.0)),
], ids=["cohere_logit_scale", "granite_logits_scaling"])
def test_scaled_heads_are_exact_with_memopts_loss_and_refused_by_liger(build):
    torch.manual_seed(0)
    model = _loud(build())
    assert head_refusal(model) is None
    assert "scales its logits" in liger_refusal(model, None)
    own, ref, fused, grads = _own_and_fused(model, "memopt")
    torch.testing.assert_close(fused, own, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="no logit scale"):
        causal_lm_chunked_loss(model, _batch(), chunks=3, kernel="liger")


def test_a_scaled_hidden_state_is_refused():
    reason = head_refusal(T.MiniCPM3ForCausalLM(T.MiniCPM3Config(**SMALL)))
    assert reason is not None and "last hidden state" in reason


@pytest.mark.parametrize("build", [lambda: ScaledLlama(T.LlamaConfig(**SMALL)),
                                   lambda: DoubleCapGemma2(T.Gemma2Config(**SMALL, head_dim=16,
                                                                          final_logit_softcapping=30.0))],
                         ids=["scale_no_config_names", "a_second_softcap"])
def test_the_probe_refuses_a_transform_the_config_does_not_declare(build):
    reason = head_refusal(build())
    assert reason is not None and "changes the logits" in reason


@pytest.mark.parametrize("build", [
    lambda: T.LlamaForCausalLM(T.LlamaConfig(**SMALL)),
    lambda: _gemma2(final_logit_softcapping=None),
    lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                                           embd_pdrop=0.0, attn_pdrop=0.0)),
], ids=["llama", "gemma2_without_softcap", "gpt2_tied"])
@pytest.mark.parametrize("kernel", ["memopt", "liger"])
def test_supported_heads_give_the_models_own_loss_and_gradients(build, kernel):
    torch.manual_seed(0)
    model = build()
    assert head_refusal(model) is None
    own, ref, fused, grads = _own_and_fused(model, kernel)
    torch.testing.assert_close(fused, own, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


def test_profile_of_a_refused_head_records_the_refusal_and_the_planner_never_chunks():
    model = T.OPTForCausalLM(T.OPTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, ffn_dim=64,
                                         vocab_size=40_000, max_position_embeddings=64, word_embed_proj_dim=16))
    prof = memopt.profile(model, {"batch_size": 2, "seq_len": 16}, hardware="h200", use_cache=False)
    assert prof.chunked_ce_refusal and "last hidden state" in prof.chunked_ce_refusal
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
    assert head_refusal(model) is None
