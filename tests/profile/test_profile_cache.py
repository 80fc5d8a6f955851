"""The profile cache keyed on model specs (no model built for a cached profile) and shared optimizer traces."""

import sys

import pytest

import memopt
from memopt.categories import MemoryCategory
from memopt.hardware import load_hardware
from memopt.models import build_model, with_overrides
from memopt.profile.cuda_semantics import kernel_policy_for
from memopt.profile.optimizer_trace import trace_optimizer
from memopt.profile.profile import Profile, optimizer_step_class

SPEC = with_overrides("tiny_llama", {"num_hidden_layers": 3, "hidden_size": 64, "intermediate_size": 128,
                                     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512})
SAMPLE = {"batch_size": 2, "seq_len": 32}
HW = load_hardware("h200")


def _forbid_building(monkeypatch, message: str) -> None:
    """``build_model`` replaced in every memopt module that holds it (``memopt.models`` and the modules that
    import it at module level), so any build raises ``message``."""

    def no_build(*args, **kwargs):
        raise AssertionError(message)

    for name, module in list(sys.modules.items()):
        if name.startswith("memopt") and getattr(module, "build_model", None) is build_model:
            monkeypatch.setattr(module, "build_model", no_build)


def test_a_cached_spec_profile_is_loaded_without_building_the_model(monkeypatch):
    first = memopt.profile(SPEC, sample=SAMPLE, hardware=HW)
    assert first.vocab_size == 512

    _forbid_building(monkeypatch, "a cached profile must not build the model")
    again = memopt.profile(SPEC, sample=SAMPLE, hardware=HW)
    assert again.key == first.key
    assert again.to_dict()["variants"] == first.to_dict()["variants"]
    assert again.can_trace() and again._model is None  # attached as a builder: built when a trace is missing


def test_a_sharded_plan_from_a_cached_profile_does_not_build_the_model(monkeypatch, tmp_path):
    """The sharding planner's parameter counts are recorded in the profile (a 70B model's rebuild and the
    transformers import took 7 s of every sharded plan): equal to the model's, and no build from the cache."""
    from memopt.profile.engine_facts import facts_of_module, facts_of_profile

    monkeypatch.setenv("MEMOPT_CACHE_DIR", str(tmp_path))
    tied = with_overrides(SPEC, {"tie_word_embeddings": True})
    first = memopt.profile(tied, sample=SAMPLE, hardware=HW)
    assert facts_of_profile(first) == facts_of_module(build_model(tied, device="meta"))
    assert facts_of_profile(first).tied_params == 512 * 64
    cold = memopt.plan(tied, SAMPLE, budget="40GB", hardware=HW, world_size=2)  # traces what it needs

    _forbid_building(monkeypatch, "the sharded plan built the model")
    plan = memopt.plan(tied, SAMPLE, budget="40GB", hardware=HW, world_size=2)
    assert plan.fits and plan.techniques["extras"]["sharding"]["world_size"] == 2
    assert plan.strategy == cold.strategy and plan.prediction == cold.prediction


def test_the_spec_key_follows_what_decides_the_traces():
    base = memopt.profile(SPEC, sample=SAMPLE, hardware=HW, use_cache=False).key
    other_sample = memopt.profile(SPEC, sample={"batch_size": 2, "seq_len": 16}, hardware=HW, use_cache=False).key
    other_config = memopt.profile(with_overrides(SPEC, {"intermediate_size": 96}), sample=SAMPLE, hardware=HW,
                                  use_cache=False).key
    assert len({base, other_sample, other_config}) == 3


def test_a_plan_from_the_cached_profile_equals_the_cold_plan():
    cold = memopt.plan(SPEC, SAMPLE, budget="40GB", hardware=HW)
    warm = memopt.plan(SPEC, SAMPLE, budget="40GB", hardware=HW)
    uncached = memopt.plan(SPEC, SAMPLE, budget="40GB", hardware=HW, use_cache=False)
    for plan in (warm, uncached):
        assert plan.strategy == cold.strategy
        assert plan.prediction == cold.prediction
        assert plan.rejected == cold.rejected


def test_a_missing_variant_is_traced_from_a_cached_profile():
    sample = {"batch_size": 2, "seq_len": 24}  # a profile of its own: no other test traced its variants
    memopt.profile(SPEC, sample=sample, hardware=HW)
    prof = memopt.profile(SPEC, sample=sample, hardware=HW)
    assert prof._model is None
    key = next(iter(prof.variants)).__class__(precision="fp32", checkpointing="full")
    trace = prof.variant(key, 2)
    assert trace.key.precision == "fp32" and prof._model is not None
    assert Profile.load(prof._cache_path).variants.keys() == prof.variants.keys()


def test_a_module_is_still_keyed_on_its_structure():
    module = build_model(SPEC)
    prof = memopt.profile(module, sample=SAMPLE, hardware=HW)
    assert prof._model is module and prof.vocab_size == 512 and not prof.key.startswith("s")


@pytest.mark.parametrize("optimizer", ["adamw_fused", "adamw_foreach", "adamw8bit", "paged_adamw8bit", "sgd"])
def test_precisions_of_one_optimizer_step_class_trace_the_same_step(optimizer):
    """fp32 and bf16 autocast share optimizer traces (Profile.optimizer reuses one for the other): prove the
    traces are equal, and that the classes that differ really trace differently."""
    assert optimizer_step_class("fp32") == optimizer_step_class("bf16_autocast")
    assert len({optimizer_step_class(p) for p in ("fp32", "fp16_autocast", "bf16_master", "bf16_pure")}) == 4
    model = build_model(SPEC)
    policy = kernel_policy_for(HW)
    fp32 = trace_optimizer(model, "fp32", optimizer, policy).to_dict()
    amp = trace_optimizer(model, "bf16_autocast", optimizer, policy).to_dict()
    assert amp.pop("precision") == "bf16_autocast" and fp32.pop("precision") == "fp32"
    assert amp == fp32


def test_the_profile_reuses_the_twin_optimizer_trace():
    prof = memopt.profile(SPEC, sample=SAMPLE, hardware=HW, use_cache=False)
    traced = prof.optimizer("fp32", "adamw_fused")
    seconds = prof.trace_s
    shared = prof.optimizer("bf16_autocast", "adamw_fused")
    assert prof.trace_s == seconds  # nothing traced
    assert shared.precision == "bf16_autocast" and shared.first == traced.first and shared.cost == traced.cost
    assert prof.optimizer("bf16_pure", "adamw_fused").first != traced.first  # bf16 weights: traced on its own


_NET = '''
import torch
from torch import nn


def widen(x):
    return {helper}


class Net(nn.Module):
    def __init__(self, heads=4):
        super().__init__()
        self.heads = heads
        self.proj = nn.Linear(64, 64)
        self.head = nn.Linear(64, 8)

    def forward(self, x):
        h = self.proj(x)
        b, t, d = h.shape
        q = h.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        scores = (q @ q.transpose(-1, -2)).softmax(-1)  # b x heads x t x t: grows with the head count
        h = (scores @ q).transpose(1, 2).reshape(b, t, d)
        return self.head({body})
'''


def _net(body: str = "widen(h)", helper: str = "x", heads: int = 4):
    """A ``Net`` made from source, as a notebook cell that is edited and run again makes it: the same class name
    and parameters each time."""
    namespace: dict = {"__name__": "notebook_cell"}
    exec(_NET.format(body=body, helper=helper), namespace)
    return namespace["Net"](heads)


@pytest.mark.parametrize("edit", ["forward", "helper", "setting"])
def test_a_model_whose_code_or_settings_changed_is_traced_again(edit, monkeypatch, tmp_path):
    """An edited forward, an edited helper it calls, or a setting that reshapes activations without touching a
    parameter: the same class name, modules and parameters, a different step. Its cached profile is not served; the
    same code defined again (another process, the cell run twice) is."""
    import torch

    monkeypatch.setenv("MEMOPT_CACHE_DIR", str(tmp_path))
    sample = (torch.randn(8, 256, 64),)
    loss = lambda out, batch: out.float().pow(2).mean()  # noqa: E731
    base = memopt.profile(_net(), sample=sample, hardware=HW, loss_fn=loss)
    assert memopt.profile(_net(), sample=sample, hardware=HW, loss_fn=loss).key == base.key
    keeps_16_copies = "torch.exp({0}.unsqueeze(-1).expand(*{0}.shape, 16)).mean(-1)"  # exp saves its output
    edited = {"forward": _net(body=keeps_16_copies.format("h")),
              "helper": _net(helper=keeps_16_copies.format("x")),
              "setting": _net(heads=16)}[edit]
    assert [p.shape for p in edited.parameters()] == [p.shape for p in _net().parameters()]
    again = memopt.profile(edited, sample=sample, hardware=HW, loss_fn=loss)
    assert again.key != base.key
    def saved(prof):  # the activations held at the step's peak
        return memopt.estimate(prof, memopt.Strategy(micro_batch_size=8)).breakdown[MemoryCategory.ACTIVATIONS]

    assert saved(again) > 1.5 * saved(base)  # traced from its own code, not served the first model's profile


def test_a_real_batchs_padding_is_traced_and_keys_the_profile(monkeypatch, tmp_path):
    """A dict batch of a Hugging Face model keeps its attention mask: padded rows make the model build a mask and
    run another attention kernel than full rows do (an all-ones mask takes the unpadded path), and which rows are
    padded is part of the key. The mask was dropped: a padded batch was planned as an unpadded one."""
    import torch

    monkeypatch.setenv("MEMOPT_CACHE_DIR", str(tmp_path))
    model = build_model(SPEC, device="meta")
    ids = torch.randint(3, 512, (4, 256), generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([256, 100, 256, 180])
    batches = {"none": {"input_ids": ids, "labels": ids.clone()},
               "ones": {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)},
               "padded": {"input_ids": ids, "labels": ids.clone(),
                          "attention_mask": (torch.arange(256) < lengths[:, None]).long()}}
    profiles = {name: memopt.profile(model, sample=batch, hardware=HW) for name, batch in batches.items()}
    peak = {name: memopt.estimate(p, memopt.Strategy(micro_batch_size=4)).peak_allocated_bytes
            for name, p in profiles.items()}
    assert peak["ones"] - peak["none"] == 8192  # the mask itself (4 x 256 int64): the same attention path
    # a materialized 4 x 1 x 256 x 256 mask and another attention kernel (memory-efficient, not cuDNN's causal one)
    assert abs(peak["padded"] - peak["ones"]) >= 4 * 256 * 256
    assert len({p.key for p in profiles.values()}) == 3
    same_rows_padded = (torch.arange(256) < torch.tensor([256, 90, 256, 170])[:, None]).long()
    other_padding = {**batches["padded"], "attention_mask": same_rows_padded}
    assert memopt.profile(model, sample=other_padding, hardware=HW).key == profiles["padded"].key


def test_a_transformers_model_with_another_attention_implementation_is_traced_again():
    """Eager attention keeps the attention probabilities that SDPA does not, with the same classes and parameters:
    the cache served one model's profile to the other (a test of the suite that built an eager model changed the
    plans of later tests of the same model with SDPA)."""
    import transformers

    from memopt.profile.cache_keys import structure_key

    def bert(**kw):
        config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=64)
        return transformers.BertForSequenceClassification._from_config(config, **kw)

    sdpa, eager, again = bert(), bert(attn_implementation="eager"), bert()
    assert structure_key(sdpa, {}) != structure_key(eager, {})
    assert structure_key(sdpa, {}) == structure_key(again, {})
    sample = {"batch_size": 2, "seq_len": 16}
    a = memopt.profile(sdpa, sample, hardware="h200")
    b = memopt.profile(eager, sample, hardware="h200")
    assert a.key != b.key


class _Tabled(__import__("torch").nn.Module):
    """A lookup table sized by a constructor argument the module does not keep (the positional-encoding pattern)."""

    def __init__(self, rows: int) -> None:
        import torch

        super().__init__()
        self.proj = torch.nn.Linear(64, 64)
        self.register_buffer("table", torch.zeros(rows, 64))

    def forward(self, x):
        return self.proj(x) + self.table[: x.shape[1]]


def _keep_three(module, args, output):
    """A user's forward hook that makes and keeps three more activations."""
    return output + output.exp() + output.sin() + output.cos()


@pytest.mark.parametrize("change", ["buffer", "instance_forward", "hook", "teacher"])
def test_what_the_model_holds_beside_its_parameters_keys_the_profile(change, monkeypatch, tmp_path):
    """A bigger buffer, a forward replaced on the instance, a forward hook, a bigger module the training step runs:
    the same classes and parameters, a step that holds more. A cached profile of the plain model was served for each
    (planned totals 240, 140, 140 and 500 MiB short): it is keyed on them now."""
    import types

    import torch

    monkeypatch.setenv("MEMOPT_CACHE_DIR", str(tmp_path))
    sample = (torch.randn(8, 128, 64),)
    small_teacher = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))

    def step_with(teacher):
        def step(model, batch):
            with torch.no_grad():
                target = teacher(batch[0])[..., :64]
            return (model(batch[0]) - target).pow(2).mean()
        return step

    def profile(model, teacher=small_teacher):
        return memopt.profile(model, sample=sample, hardware=HW, training_step=step_with(teacher))

    base = profile(_Tabled(128))
    assert profile(_Tabled(128)).key == base.key
    if change == "buffer":
        again = profile(_Tabled(1 << 16))
    elif change == "instance_forward":
        model = _Tabled(128)
        model.forward = types.MethodType(lambda self, x: _keep_three(self, (x,), self.proj(x)), model)
        again = profile(model)
    elif change == "hook":
        model = _Tabled(128)
        model.proj.register_forward_hook(_keep_three)
        again = profile(model)
    else:
        big = torch.nn.Sequential(torch.nn.Linear(64, 8192), torch.nn.Linear(8192, 64))
        again = profile(_Tabled(128), teacher=big)
    assert again.key != base.key
    strategy = memopt.Strategy(micro_batch_size=8, precision="fp32")
    assert memopt.estimate(again, strategy).peak_allocated_bytes > memopt.estimate(base, strategy).peak_allocated_bytes
