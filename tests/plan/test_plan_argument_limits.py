"""Arguments memopt.plan cannot plan as given: a budget beyond the device is planned for the device's memory (a plan
for memory the GPU lacks would not run on it); a pin the model cannot take exactly, and a hardware dict short of a
field, are refused in one line naming the fix."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

import memopt
from memopt.errors import InputError
from memopt.plan.context import resolve_hardware

SAMPLE = {"batch_size": 2, "seq_len": 64}


def test_a_budget_beyond_the_device_is_planned_for_the_device():
    device = resolve_hardware("h100_80gb").memory_bytes
    plan = memopt.plan("tiny_llama", SAMPLE, budget="500GB", hardware="h100_80gb")
    assert plan.budget_bytes == device
    assert any(n.endswith(f"planned for the device's {memopt.units.format_bytes(device)}") for n in plan.notes)
    same = memopt.plan("tiny_llama", SAMPLE, budget=device, hardware="h100_80gb")
    assert (plan.strategy, plan.total_bytes) == (same.strategy, same.total_bytes)


def test_chunked_cross_entropy_pinned_on_a_head_with_a_bias_names_the_reason():
    config = transformers.GPTJConfig(n_embd=32, n_layer=2, n_head=4, vocab_size=128, n_positions=64, rotary_dim=4)
    model = transformers.GPTJForCausalLM(config)
    with pytest.raises(InputError, match=r"pin chunked_ce=4 cannot be honoured: chunked cross-entropy would not be "
                                         r"exact for this model \(GPTJForCausalLM's head has a bias\); drop the pin"):
        memopt.plan(model, SAMPLE, budget="8GB", hardware="h100_80gb", pins={"chunked_ce": 4})


class _PlainLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(2))
        self.head = torch.nn.Linear(32, 64, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _bert_mlm() -> torch.nn.Module:
    return transformers.BertForMaskedLM(transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                                num_attention_heads=2, intermediate_size=64))


@pytest.mark.parametrize("offload", [None, False])
@pytest.mark.parametrize("which", ["bert_mlm", "plain"])
def test_chunked_cross_entropy_pinned_on_a_model_that_is_not_a_causal_lm_says_so(which, offload):
    """Without a causal LM's head the search had no candidate: the planner fell through to an offload plan's pin
    check, or to "no candidate could be estimated", with no word of why."""
    ids = torch.randint(0, 64, (4, 8))
    if which == "bert_mlm":
        model, sample, kw, name = _bert_mlm(), {"input_ids": ids, "labels": ids}, {}, "BertForMaskedLM"
    else:
        model, sample, name = _PlainLM(), (ids, ids), "_PlainLM"
        kw = {"loss_fn": lambda out, b: torch.nn.functional.cross_entropy(out.flatten(0, 1), b[1].flatten())}
    pins = {"chunked_ce": 4} | ({} if offload is None else {"offload": offload})
    with pytest.raises(InputError, match=rf"^pin chunked_ce=4 cannot be honoured: {name} is not a Hugging "
                                         r"Face causal LM, .*; drop the pin$"):
        memopt.plan(model, sample, budget="16GB", hardware="h100_80gb", pins=pins, **kw)


def test_a_hardware_dict_missing_a_field_names_the_fields_it_needs():
    full = dataclasses.asdict(resolve_hardware("h100_80gb"))
    partial = {"name": "mygpu", "memory_bytes": 80 * 10**9}
    with pytest.raises(InputError, match=r"hardware dict lacks '\w+': give each of name, .*, or a shipped name"):
        memopt.plan("tiny_llama", SAMPLE, budget="8GB", hardware=partial)
    assert memopt.plan("tiny_llama", SAMPLE, budget="8GB", hardware=full).fits  # the complete dict plans


class _NeverTraced(torch.nn.Module):
    """A model whose step fails: a refusal that reaches it came after tracing had started."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("traced")


@pytest.mark.parametrize(("hardware", "fidelity", "forbid", "named"), [
    ("h100_80gb", "default", {"precision": ["fp32", "bf16_autocast"]},
     "the policy leaves no precision to plan on h100_80gb: of fp32, fp16_autocast, bf16_autocast, bf16_master, "
     "bf16_pure it forbids fp32, bf16_autocast, and the fidelity (bf16_autocast, exact) allows no other; un-forbid "
     "one, or widen the fidelity (fp16_autocast, bf16_master need 'mixed_precision'; bf16_pure needs 'lossy')"),
    ("t4", "mixed", {"precision": ["fp32", "fp16_autocast"]},
     "the policy leaves no precision to plan on t4: of fp32, fp16_autocast it forbids fp32, fp16_autocast"),
    ("h100_80gb", "default", {"optimizer": ["adamw_fused", "adamw_foreach", "adamw", "sgd"]},
     "the policy leaves no optimizer to plan on h100_80gb"),
    ("h100_80gb", "exact", {"checkpointing": ["none", "full", "selective"]},
     "the policy leaves no checkpointing to plan on h100_80gb: of none, full, selective it forbids none, full, "
     "selective"),
])
def test_a_policy_that_leaves_a_technique_nothing_is_refused_before_tracing(hardware, fidelity, forbid, named):
    with pytest.raises(InputError) as err:
        memopt.plan(_NeverTraced(), (torch.randn(4, 4),), budget="8GB", hardware=hardware, fidelity=fidelity,
                    forbid=forbid, loss_fn=lambda out, b: out.sum())
    assert named in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(("override", "line"), [
    ({"peak_flops": {"bf16": -1.0}}, r"hardware.peak_flops.bf16=-1.0 must be a finite number > 0"),
    ({"peak_flops": {"bf16": 0.0}}, r"hardware.peak_flops.bf16=0.0 must be a finite number > 0"),
    ({"memory_bytes": -5}, r"hardware.memory_bytes=-5 must be an integer > 0"),
    ({"hbm_bandwidth": 0}, r"hardware.hbm_bandwidth=0(.0)? must be a finite number > 0"),
    ({"compute_capability": [99]}, r"hardware.compute_capability=\[99\] must be a pair of integers"),
    ({"num_sms": -3}, r"hardware.num_sms=-3 must be an integer >= 0"),
])
def test_a_hardware_field_out_of_range_is_refused_naming_it(override, line):
    """A negative FLOP/s planned at a negative step time, zeros divided by zero, a one-number compute capability
    raised IndexError: each field is checked, as a dict, as a spec's override and on the command line's path."""
    spec = dataclasses.asdict(memopt.load_hardware("h100_80gb"))
    spec.update(override)
    with pytest.raises(InputError, match=line):
        memopt.load_hardware(spec)
    with pytest.raises(InputError, match=line):
        memopt.plan("tiny_gpt2", SAMPLE, budget="4GB", hardware=spec)
    if "compute_capability" not in override:
        with pytest.raises(InputError, match=line):
            memopt.load_hardware("h100_80gb").with_overrides(**override)


def test_bad_input_to_the_entry_points_is_an_input_error(tmp_path):
    """Each was a plain ValueError, which ``except memopt.InputError`` missed (it stays a ValueError)."""
    cases = [(lambda: memopt.plan("tiny_gpt2", SAMPLE, budget="500MB", hardware="h100_80gb"), "below what the CUDA"),
             (lambda: memopt.plan("tiny_gtp2", SAMPLE, budget="4GB", hardware="h100_80gb"), "unknown model"),
             (lambda: memopt.plan("tiny_gpt2", {"batch_size": 2, "seqlen": 32}, budget="4GB", hardware="h100_80gb"),
              "unknown keys"),
             (lambda: memopt.plan("tiny_gpt2", SAMPLE, budget="4GB", hardware="h100_80gb", world_size=4),
              "does not split over 4 GPUs"),
             (lambda: memopt.profile("tiny_gpt2", SAMPLE, hardware="h100"), "unknown hardware 'h100'"),
             (lambda: memopt.Plan.load(tmp_path / "none.json"), "no plan file"),
             (lambda: memopt.wrap(torch.nn.Linear(4, 4), plan=tmp_path / "none.json"), "no plan file")]
    for call, message in cases:
        with pytest.raises(InputError, match=message) as info:
            call()
        assert isinstance(info.value, ValueError)
    plan = memopt.plan("tiny_gpt2", SAMPLE, budget="4GB", hardware="h100_80gb")
    with pytest.raises(InputError, match=r"fidelity='exact' would plan otherwise"):
        memopt.wrap(torch.nn.Linear(4, 4), plan=plan, fidelity="exact", allow_plan_mismatch=True)
    with pytest.raises(InputError, match="schema version 7"):
        memopt.Plan.from_dict({**plan.to_dict(), "schema_version": 7})
