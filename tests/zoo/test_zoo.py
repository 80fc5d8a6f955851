"""The conformance zoo: every family and pattern is planned on the CPU, its composed estimate equals the
simulation of the same step, and 3 steps through ``memopt.wrap`` under a technique equal an unwrapped loop
(losses, parameters and buffers). Techniques are spread over the families (``Family.technique``)."""

from __future__ import annotations

import pytest
import torch

import memopt
from memopt.blocks import find_block_stacks
from memopt.models import SampleSpec, make_batch
from memopt.models.hf_task import hf_task
from memopt.profile.batch_factories import spec_from_module
from memopt.profile.cuda_semantics import kernel_policy_for
from memopt.profile.head_probe import head_refusal
from memopt.profile.simulate import simulate_step
from memopt.strategy import Checkpointing, Strategy
from tests.zoo.hf_families import FAMILIES, NOT_IN_ZOO, TASKS, families_by_task
from tests.zoo.torch_patterns import PATTERNS

BATCH = 4
STEPS = 3
LR = 0.05
TECHNIQUES = {
    "full": {"checkpointing": "full"},
    "selective": {"checkpointing": "selective"},
    "partial": {"checkpointing": "full", "checkpoint_blocks": 1},
    "micro_batch": {"micro_batch_size": 2},
    "chunked_ce": {"chunked_ce": 4},
    "offload": {"activation_offload": True},
    "bf16": {"precision": "bf16_autocast"},
}
# the families whose estimate and equivalence checks run in the fast tier: every technique meets every kind of
# block among them (decoder, MoE decoder, encoder-decoder, encoder, vision transformer, convolutional stages);
# the other families' checks are slow-marked (every family is planned in the fast tier)
CORE = {"causal_lm:llama", "causal_lm:gpt2", "causal_lm:mistral", "causal_lm:qwen2", "causal_lm:gemma",
        "causal_lm:gemma2", "causal_lm:qwen2_moe", "causal_lm:mixtral", "seq2seq_lm:t5", "seq2seq_lm:bart",
        "masked_lm:bert", "masked_lm:roberta", "sequence_classification:bert", "token_classification:bert",
        "image_classification:vit", "image_classification:convnext", "image_classification:resnet"}


def _tiered(families):
    return [f if f.id in CORE else pytest.param(f, marks=pytest.mark.slow) for f in families]


EXACT = {"precision": "fp32", "optimizer": "sgd", "micro_batch_size": BATCH, "checkpointing": "none",
         "activation_offload": False, "chunked_ce": 0}


def _strategy(technique: str) -> Strategy:
    """The technique as a strategy at micro-batch 2 of 4 (the estimate's check)."""
    pins = TECHNIQUES[technique]
    ck = Checkpointing(mode=pins.get("checkpointing", "none"), num_blocks=pins.get("checkpoint_blocks"))
    return Strategy(precision=pins.get("precision", "bf16_autocast"), checkpointing=ck,
                    activation_offload=pins.get("activation_offload", False), chunked_ce=pins.get("chunked_ce", 0),
                    micro_batch_size=2, grad_accum_steps=BATCH // 2)


def _hf_batches(model, fam, n=STEPS):
    spec = spec_from_module(model)
    g = torch.Generator().manual_seed(7)
    sample = SampleSpec.parse(fam.sample(BATCH), spec)
    return [make_batch(spec, sample, generator=g, config=model.config) for _ in range(n)]


def _reference(model, batches, *, loss_fn=None, bf16=False, max_grad_norm=None):
    """The unwrapped loop: one forward and backward over the whole batch, clipping, SGD with momentum."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=0.9)
    losses = []
    for b in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model(**b)
            if loss_fn is not None:
                loss = loss_fn(out, b)
            elif isinstance(out, tuple):  # (logits, loss)
                loss = next(t for t in out if t.dim() == 0)
            else:
                loss = out["loss"] if isinstance(out, dict) else out.loss
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def _check_equivalence(build, batches, sample, technique, *, loss_fn=None, max_grad_norm=None):
    pins = {**EXACT, **TECHNIQUES[technique]}
    torch.manual_seed(11)
    model = build()
    longest = max((len(s) for s in find_block_stacks(model)), default=0)
    if technique == "full" and longest:
        pins["checkpoint_blocks"] = longest  # every block of every stack: at a roomy budget the planner needs one
    bf16 = pins["precision"] == "bf16_autocast"
    wrapped = memopt.wrap(model, budget="20GB", sample=sample, hardware="h200", optimizer="sgd", lr=LR,
                          pins=pins, guard=False, autotune=False, loss_fn=loss_fn, max_grad_norm=max_grad_norm)
    if technique == "full" and longest:
        assert wrapped.plan.strategy.checkpointing.count(longest) == longest
    torch.manual_seed(11)
    got = [wrapped.step({k: v.clone() for k, v in b.items()}) for b in batches]
    ref_model = build()
    torch.manual_seed(11)
    want = _reference(ref_model, batches, loss_fn=loss_fn, bf16=bf16, max_grad_norm=max_grad_norm)
    tol = dict(rtol=2e-3, atol=2e-4) if bf16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **tol)
    model = wrapped.unwrap()
    for (name, a), (_, b) in zip(model.state_dict().items(), ref_model.state_dict().items()):
        if a.is_floating_point():
            torch.testing.assert_close(a, b, **tol, msg=lambda m, name=name: f"{name}: {m}")
    return wrapped


def _estimate_equals_simulation(model, sample, strategy, loss_fn=None):
    prof = memopt.profile(model, sample, hardware="h200", loss_fn=loss_fn)
    est = memopt.estimate(prof, strategy, num_steps=3)
    factory = prof._batch_factory
    sim = simulate_step(model, lambda d: factory(BATCH, d), strategy, loss_fn=loss_fn,
                        policy=kernel_policy_for(memopt.load_hardware("h200")), num_steps=3)
    assert est.peak_allocated_bytes == pytest.approx(sim.peak_allocated_bytes, rel=0.01)


# -- Hugging Face families ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fam", FAMILIES, ids=lambda f: f.id)
def test_family_is_recognised_and_planned(fam):
    model = fam.build()
    assert hf_task(model) == fam.task
    plan = memopt.plan(model, fam.sample(BATCH), budget="10GB", hardware="h200")
    assert plan.fits and plan.total_bytes > 0
    if fam.task == "causal_lm":  # the plan's notes say whether the fused loss is refused, and why
        reason = head_refusal(model)
        noted = [n for n in plan.notes if "chunked cross-entropy refused" in n]
        assert noted == ([] if reason is None else [f"chunked cross-entropy refused (it would not be exact): {reason}"])


@pytest.mark.parametrize("fam", _tiered(FAMILIES), ids=lambda f: f"{f.id}:{f.technique}")
def test_family_estimate_equals_simulation(fam):
    _estimate_equals_simulation(fam.build(), fam.sample(BATCH), _strategy(fam.technique))


@pytest.mark.parametrize("fam", _tiered(FAMILIES), ids=lambda f: f"{f.id}:{f.technique}")
def test_family_wrapped_steps_equal_the_unwrapped_loop(fam):
    model = fam.build()
    _check_equivalence(fam.build, _hf_batches(model, fam), fam.sample(BATCH), fam.technique)


def test_every_task_of_the_mappings_is_in_the_zoo_and_listed_families_exist():
    mapped = families_by_task()
    for task in TASKS:
        assert any(f.task == task for f in FAMILIES), task
    for fam in FAMILIES:
        assert fam.model_type in mapped[fam.task], fam.id
    assert {f.id for f in FAMILIES} >= CORE
    for key in NOT_IN_ZOO:
        task, model_type = key.split(":")
        assert model_type in mapped[task], key


# -- plain PyTorch patterns --------------------------------------------------------------------------------------

@pytest.mark.parametrize("pat", PATTERNS, ids=lambda p: p.name)
def test_pattern_is_planned(pat):
    plan = memopt.plan(pat.build(), pat.sample(BATCH), budget="10GB", hardware="h200", loss_fn=pat.loss_fn)
    assert plan.fits


@pytest.mark.parametrize("pat", PATTERNS, ids=lambda p: f"{p.name}:{p.technique}")
def test_pattern_estimate_equals_simulation(pat):
    strategy = _strategy(pat.technique)
    _estimate_equals_simulation(pat.build(), pat.sample(BATCH), strategy.replace(optimizer=pat.optimizer or
                                                                                 strategy.optimizer),
                                loss_fn=pat.loss_fn)


@pytest.mark.parametrize("pat", PATTERNS, ids=lambda p: f"{p.name}:{p.technique}")
def test_pattern_wrapped_steps_equal_the_unwrapped_loop(pat):
    g = torch.Generator().manual_seed(5)
    batches = [pat.sample(BATCH, g) for _ in range(STEPS)]
    torch.manual_seed(0)
    _check_equivalence(lambda: (torch.manual_seed(3), pat.build())[1], batches, pat.sample(BATCH),
                       pat.technique, loss_fn=pat.loss_fn, max_grad_norm=pat.max_grad_norm)
