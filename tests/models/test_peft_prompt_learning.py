"""peft's prompt learning on a causal LM: the ``PeftModel`` of prefix or prompt tuning holds the transformers model
itself as ``base_model`` (``base_model.model`` is only its trunk), and its label counts follow how the virtual tokens
reach the model: prefix tuning passes them as keys and values (the labels shift by one, as the LM's own), prompt
tuning puts them before each row (the first label then carries a loss too)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as T

import memopt
from memopt.models.hf_task import is_causal_lm
from tests.reference_loop import losses_of_plain_loop

peft = pytest.importorskip("peft")

LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, pad_token_id=0)
B, L = 8, 12


def _tuned(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cls = peft.PrefixTuningConfig if kind == "prefix" else peft.PromptTuningConfig
    config = cls(num_virtual_tokens=4, task_type=peft.TaskType.CAUSAL_LM)
    return peft.get_peft_model(T.LlamaForCausalLM(T.LlamaConfig(**LLAMA)), config)


def _padded_batches(n: int = 3) -> list[dict[str, torch.Tensor]]:
    """Rows right-padded to different lengths, so micro-batches carry different numbers of loss tokens."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(3, LLAMA["vocab_size"], (B, L), generator=g)
        mask, labels = torch.ones(B, L, dtype=torch.long), ids.clone()
        for i in range(1, B, 2):
            mask[i, L - i:], labels[i, L - i:], ids[i, L - i:] = 0, -100, 0
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


@pytest.mark.parametrize("kind, causal", [("prefix", True), ("prompt", False)])
def test_prompt_learning_is_recognised_and_its_micro_batches_train_as_the_whole_batch(kind, causal):
    model = _tuned(kind)
    assert is_causal_lm(model) is causal
    batches = _padded_batches()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    want = losses_of_plain_loop(ref, batches, lambda m, b: m(**b).loss, opt)
    w = memopt.wrap(model, budget="16GB", sample=batches[0], hardware="h100_80gb", device="cpu", use_cache=False,
                    pins={"micro_batch_size": 2, "precision": "fp32"},
                    optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0))
    got = [float(w.step(b)) for b in batches]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)


def test_pinned_checkpointing_under_prefix_tuning_is_refused_in_one_line():
    """Each attention layer appends to the prefix's key/value cache, so a recomputed block would append twice."""
    batches = _padded_batches(1)
    with pytest.raises(ValueError, match=r"checkpointing='full' cannot be honoured: peft prefix_tuning .* twice") as e:
        memopt.wrap(_tuned("prefix"), budget="16GB", sample=batches[0], hardware="h100_80gb", device="cpu",
                    use_cache=False, pins={"checkpointing": "full"})
    assert "\n" not in str(e.value)


def test_memopt_adds_no_adapters_to_a_peft_model():
    """A peft model trains what its peft config says: the ladder offers no LoRA of memopt's on top (the plan says
    why), and a pinned adapter rank is refused with the reason."""
    batches = _padded_batches(1)
    plan = memopt.plan(_tuned("prefix"), batches[0], budget="16GB", hardware="h100_80gb", fidelity="lora",
                       use_cache=False)
    assert plan.strategy.extra("adapters") is None
    assert any(n.startswith("adapters refused: the model is a peft model already") for n in plan.notes)
    with pytest.raises(ValueError, match=r"adapter_rank=4.* cannot be honoured: the model is a peft model already"):
        memopt.plan(_tuned("prefix"), batches[0], budget="16GB", hardware="h100_80gb", fidelity="lora",
                    pins={"adapter_rank": 4}, use_cache=False)
