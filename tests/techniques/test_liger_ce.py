"""Liger-kernel's fused linear cross-entropy as a planned kernel of the fused loss: its chunk rule, where the
planner offers it (installed, a GPU it runs on, a head it is exact for), what a pin of it says when it cannot be
honoured, what its trace allocates, and on a GPU the real kernel against the model's own loss."""

import pytest
import torch
import transformers as T

import memopt
import memopt.plan.context as context
from memopt.strategy import Strategy
from memopt.techniques.liger_ce import _LigerShaped, liger_chunk_size

CFG = dict(vocab_size=40_000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=4)
SAMPLE = {"batch_size": 4, "seq_len": 64}


@pytest.mark.parametrize(("tokens", "hidden", "vocab", "chunk"), [
    (16384, 2304, 256_000, 256),  # ceil(256000/2304) = 112; ceil(16384/112) = 147 -> 256
    (8, 4096, 32_000, 1),  # 8 tokens over 8 chunks
    (3, 4096, 1000, 3),  # one chunk, never more tokens than there are
    (4096, 64, 40_000, 8),  # 625 chunks' worth: ceil(4096/625) = 7 -> 8
])
def test_chunk_rule_is_ligers(tokens, hidden, vocab, chunk):
    assert liger_chunk_size(tokens, hidden, vocab) == chunk


def _llama(**kw):
    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(**{**CFG, **kw}))


def test_planned_only_where_installed(monkeypatch):
    monkeypatch.setattr(context, "liger_installed", lambda: False)
    with pytest.raises(ValueError, match="liger-kernel and triton are not installed"):
        memopt.plan(_llama(), SAMPLE, budget="8GB", hardware="h200", pins={"ce_kernel": "liger", "chunked_ce": 8})
    monkeypatch.setattr(context, "liger_installed", lambda: True)
    plan = memopt.plan(_llama(), SAMPLE, budget="8GB", hardware="h200", pins={"ce_kernel": "liger", "chunked_ce": 8})
    assert plan.fits and plan.strategy.ce_kernel == "liger" and "chunked-ce=liger" in plan.strategy.label()
    assert plan.to_dict()["techniques"]["ce_kernel"] == "liger"


def test_refused_for_a_scaled_head_and_a_gpu_it_does_not_run_on(monkeypatch):
    monkeypatch.setattr(context, "liger_installed", lambda: True)
    granite = T.GraniteForCausalLM(T.GraniteConfig(**CFG, logits_scaling=4.0))
    with pytest.raises(ValueError, match="scales its logits"):
        memopt.plan(granite, SAMPLE, budget="8GB", hardware="h200", pins={"ce_kernel": "liger", "chunked_ce": 8})
    with pytest.raises(ValueError, match="older than"):
        memopt.plan(_llama(), SAMPLE, budget="8GB", hardware="t4", pins={"ce_kernel": "liger", "chunked_ce": 8})
    with pytest.raises(ValueError, match="chunked_ce=0 switches off"):
        memopt.plan(_llama(), SAMPLE, budget="8GB", hardware="h200", pins={"ce_kernel": "liger", "chunked_ce": 0})


def test_a_plan_without_the_kernel_serializes_as_before():
    assert "ce_kernel" not in Strategy(chunked_ce=8).to_dict()
    s = Strategy(chunked_ce=8, ce_kernel="liger")
    assert Strategy.from_dict(s.to_dict()) == s


def test_its_trace_allocates_what_liger_allocates():
    """Under fake tensors the stand-in holds, besides its inputs: the hidden-state and weight gradients, one fp32
    loss per token and, per chunk, the chunk's logits and its hidden-state gradient; nothing vocabulary-sized in
    fp32, nothing weight-sized beyond the gradient and autocast's casts."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memopt.profile.tracker import MemoryTracker

    n, h, v = 4096, 64, 40_000
    chunk = liger_chunk_size(n, h, v)
    with FakeTensorMode(), MemoryTracker("cpu") as tracker:
        x = torch.randn(n, h, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(v, h, requires_grad=True)
        y = torch.randint(0, v, (n,))
        base = tracker.current_bytes
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _LigerShaped.apply(x, w, y, None, -100)
        extra = tracker.peak_bytes - base
    held = n * h * 2 + v * h * 4 + n * 4  # grad_input, grad_weight (fp32 like the weight), loss_1d
    per_chunk = chunk * v * 2 + chunk * h * 2  # the chunk's bf16 logits and its grad_input rows
    # autocast's bf16 copies of the fp32 weight, as Liger's own code makes them: the cached one of the leaf (``z @
    # weight``) and, each chunk, an uncached one of its transpose (``x @ weight.t()``: a view is not cached)
    casts = 2 * v * h * 2
    assert abs(extra - (held + per_chunk + casts)) <= 64 * 1024


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_real_kernel_gives_the_models_own_loss_and_gradients():
    pytest.importorskip("liger_kernel")
    from memopt.techniques.chunked_ce import causal_lm_chunked_loss

    for model in (_llama().cuda(), T.Gemma2ForCausalLM(T.Gemma2Config(**CFG, head_dim=16,
                                                                       final_logit_softcapping=30.0)).cuda()):
        ids = torch.randint(0, CFG["vocab_size"], (2, 64), device="cuda")
        batch = {"input_ids": ids, "labels": ids.clone()}
        own = model(**batch).loss
        own.backward()
        ref = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        fused = causal_lm_chunked_loss(model, batch, chunks=8, kernel="liger")
        fused.backward()
        torch.testing.assert_close(fused, own, rtol=1e-4, atol=1e-5)
        for p, r in zip(model.parameters(), ref):
            torch.testing.assert_close(p.grad, r, rtol=1e-3, atol=1e-5)
