"""Where every predicted byte goes: the dry run's attribution (module group x category at the predicted peak)
against the estimate's own figures, hand arithmetic on a tiny model, and a fake-tensor run of the whole
full-depth model recorded by module (no composition involved)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import memopt
from memopt.estimate.attribution import predict_attribution, split_exact
from memopt.guard.attribution import StepAttribution
from memopt.models import with_overrides
from memopt.profile.cuda_semantics import cuda_semantics, kernel_policy_for
from memopt.profile.fake_model import fake_copy
from memopt.profile.hf_compat import real_code_paths
from memopt.profile.stand_ins import TRACE_STAND_INS
from memopt.step.prepare import prepare
from memopt.strategy import Checkpointing, Strategy
from memopt.units import allocator_size as a

V, D, B, T = 512, 32, 8, 256


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 4 * D)
        self.fc2 = nn.Linear(4 * D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(F.gelu(self.fc1(self.norm(h))))


class MLPLM(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(D, V)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        logits = self.head(h)
        return {"loss": F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))}


def _sample() -> dict[str, torch.Tensor]:
    return {"input_ids": torch.zeros(B, T, dtype=torch.long), "labels": torch.zeros(B, T, dtype=torch.long)}


FP32 = Strategy(precision="fp32", optimizer="adamw_fused", micro_batch_size=B)  # the whole batch at once


@pytest.fixture(scope="module")
def mlp_profile():
    torch.manual_seed(0)
    model = MLPLM(7)
    return model, memopt.profile(model, sample=_sample(), hardware="h200", use_cache=False)


@pytest.fixture(scope="module")
def llama_profile():
    spec = with_overrides("tiny_llama", {"num_hidden_layers": 7})
    return memopt.profile(spec, sample={"batch_size": 4, "seq_len": 64}, hardware="h200", use_cache=False)


LLAMA = {
    "bf16_accum": Strategy(precision="bf16_autocast", micro_batch_size=2, grad_accum_steps=2),
    "ckpt3": Strategy(precision="bf16_autocast", micro_batch_size=2, grad_accum_steps=2,
                      checkpointing=Checkpointing(mode="full", num_blocks=3)),
    "bf16_master": Strategy(precision="bf16_master", optimizer="adamw_foreach", micro_batch_size=4),
}


@pytest.mark.parametrize("name", sorted(LLAMA))
def test_rows_add_up_to_the_estimate_exactly(llama_profile, name):
    strategy = LLAMA[name]
    est = memopt.estimate(llama_profile, strategy)
    attr = predict_attribution(llama_profile, strategy, prediction=est.to_dict())
    cells = sum(v for g in attr["by_group"].values() for v in g.values())
    assert cells == attr["total_bytes"] == est.total_bytes
    assert attr["by_category"] == {str(c): v for c, v in est.breakdown.items() if v}
    assert attr["groups"][:2] == ["embedding", "model.layers"] and "head and loss" in attr["groups"]
    # each step's own peak is no higher than the run's, and the steady step's is the run's when it is later
    assert max(s["peak_allocated_bytes"] for s in attr["steps"]) == est.peak_allocated_bytes


def test_parameter_and_optimizer_bytes_per_group_by_hand(mlp_profile):
    model, prof = mlp_profile
    attr = predict_attribution(prof, FP32)

    def params(mod: nn.Module) -> int:
        return sum(a(4 * p.numel()) for p in mod.parameters())

    def states(mod: nn.Module) -> int:  # fused AdamW: exp_avg, exp_avg_sq and a device step per parameter
        return sum(2 * a(4 * p.numel()) + a(4) for p in mod.parameters())

    groups = attr["steps"][1]["by_group"]  # the steady step: every optimizer state exists
    for name, mod in (("embedding", model.embed), ("blocks", model.blocks), ("head and loss", model.head)):
        assert groups[name]["parameters"] == params(mod), name
        assert groups[name]["optimizer_states"] == states(mod), name


def test_activation_bytes_of_an_mlp_block_by_hand(mlp_profile):
    _model, prof = mlp_profile
    attr = predict_attribution(prof, FP32)
    n = B * T
    mods = attr["steps"][0]["by_module"]  # the peak of the first step: in the loss backward, every block saved
    assert mods["blocks.*.norm"]["activations"] == 7 * (2 * a(4 * n) + a(4 * D * n))  # mean, rstd, output
    assert mods["blocks.*.fc1"]["activations"] == 7 * a(16 * D * n)  # saved for gelu
    assert mods["blocks.*"]["activations"] == 7 * (a(16 * D * n) + a(4 * D * n))  # gelu output, residual sum
    assert "activations" not in mods["blocks.*.fc2"]  # its output is freed once added to the residual
    assert mods["embed"]["activations"] == a(4 * D * n)


def _recorded_full_depth(model: nn.Module, strategy: Strategy, batch_fn) -> dict:
    """The second step of the whole model on fake tensors, CUDA semantics emulated, recorded by module (the
    steady state: the first creates the optimizer states and the backward thread's cuBLAS workspace)."""
    policy = kernel_policy_for(memopt.load_hardware("h200"))
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    clone = fake_copy(model, fake_mode, "cpu")
    clone.train()
    with fake_mode, real_code_paths():
        prepared = prepare(clone, strategy, device_type="cpu", stand_ins=TRACE_STAND_INS, host_device="meta")
        batch = batch_fn()
        rec = StepAttribution(prepared.step.model, prepared.optimizer, device_type="cpu",
                              master=prepared.step.master, batch=batch)
        try:
            with cuda_semantics(policy, rec.tracker, []):
                with rec.tracker:  # the first step, counted so its workspaces are the recorder's
                    prepared.step.step(batch)
                rec.tracker.record = True
                with rec:
                    prepared.step.on_phase = rec.on_phase
                    prepared.step.step(batch)
        finally:
            prepared.undo()
    return rec.result


@pytest.mark.parametrize("strategy", [FP32, FP32.replace(checkpointing=Checkpointing(mode="full", num_blocks=4)),
                                      FP32.replace(micro_batch_size=B // 2, grad_accum_steps=2)],
                         ids=["fp32", "ckpt4", "accum2"])
def test_composed_table_equals_the_full_depth_run_recorded_by_module(mlp_profile, strategy):
    model, prof = mlp_profile
    predicted = predict_attribution(prof, strategy)["steps"][1]
    measured = _recorded_full_depth(model, strategy, _sample)
    # the real step keeps scalars the trace has no counterpart of (each micro-batch's weighted loss, the running
    # total, the kept losses of earlier micro-batches): 512 bytes each
    scalar = 512 * (1 + 2 * (strategy.grad_accum_steps - 1))
    assert 0 <= measured["peak_allocated_bytes"] - predicted["peak_allocated_bytes"] <= scalar
    assert predicted["residual_bytes"] == 0 if "residual_bytes" in predicted else True
    for group in set(measured["by_group"]) | set(predicted["by_group"]):
        m, p = dict(measured["by_group"].get(group, {})), dict(predicted["by_group"].get(group, {}))
        if group == "head and loss":  # the scalars are the loss's: activations or temporaries by their lifetime
            step_m = m.pop("activations", 0) + m.pop("temporaries", 0)
            step_p = p.pop("activations", 0) + p.pop("temporaries", 0)
            assert 0 <= step_m - step_p <= scalar
        assert m == p, group

    def per_module(table: dict) -> dict:  # optimizer states are split by group only in the prediction
        return {mod: {c: v for c, v in cats.items() if c not in ("group", "optimizer_states")}
                for mod, cats in table["by_module"].items() if not mod.startswith("(")}

    assert per_module(measured) == per_module(predicted)


def test_split_exact_keeps_the_total():
    assert sorted(split_exact(10, {"a": 1, "b": 1, "c": 1}).values()) == [3, 3, 4]
    assert split_exact(7, {"a": 7, "b": 0}) == {"a": 7, "b": 0}
    assert sum(split_exact(1001, {"x": 3, "y": 5, "z": 11}).values()) == 1001


def test_a_profile_without_attribution_is_explained_and_the_plan_still_made(llama_profile):
    import copy

    from memopt.estimate.attribution import attach_to_plan
    from memopt.plan.schema import Plan

    strategy = LLAMA["bf16_accum"]
    old = copy.copy(llama_profile)
    old.variants = {k: copy.copy(v) for k, v in llama_profile.variants.items()}
    for v in old.variants.values():
        v.attribution = None  # as cached by a memopt before attribution
        v.__dict__.pop("_attr_maps", None)
    old._model = old._model_builder = None  # loaded from the cache: nothing to trace again
    est = memopt.estimate(llama_profile, strategy)
    with pytest.raises(ValueError, match="profile the model again"):
        predict_attribution(old, strategy, prediction=est.to_dict())
    plan = Plan(fits=True, strategy=strategy, budget_bytes=1 << 34, margin_bytes=0, prediction=est.to_dict(),
                model={}, hardware="h200", policy={}, global_batch=4)
    attach_to_plan(plan, old, "h200")
    assert "attribution" not in plan.prediction and any("no memory attribution" in n for n in plan.notes)
    attach_to_plan(plan, llama_profile, "h200")
    assert plan.prediction["attribution"]["total_bytes"] == plan.total_bytes
