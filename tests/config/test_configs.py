"""The dry run's configs: every shipped YAML composes and validates, every recipe composes (and, slow, plans),
and bad input is reported all at once with what would be valid."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from memopt.config import (
    ForbidConfig,
    HardwareConfig,
    PinsConfig,
    compose_plan_config,
    diagnose,
    resolve,
    validate,
)
from memopt.config.validate import ConfigError
from memopt.hardware import HardwareSpec
from memopt.plan.policy import PINNABLE
from memopt.resources import configs_dir

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"
GROUPS = ("model", "hardware", "policy", "training")
# training presets set long sequences; pair them with a model whose positions reach them
TRAINING_MODEL = "llama32_1b"


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MEMOPT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "memopt-cache"))


def _group_files() -> list[tuple[str, str]]:
    return [(g, p.stem) for g in GROUPS for p in sorted((configs_dir() / g).glob("*.yaml"))]


def _recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES.glob("*.yaml"))


# -- the shipped configs ----------------------------------------------------------------------------------------


def test_groups_are_shipped():
    for group, names in {"policy": {"default", "exact", "mixed", "8bit", "lossy"},
                         "training": {"default"}, "model": {"gpt2", "llama3_8b"}, "hardware": {"h100_80gb"}}.items():
        assert names <= {p.stem for p in (configs_dir() / group).glob("*.yaml")}, group


def test_bundled_default_composes_and_validates():
    cfg = compose_plan_config()
    assert validate(cfg) == []
    request = resolve(cfg)
    assert request.model_label == "gpt2" and request.hardware.name == "h100_80gb"
    assert request.budget == "24GB" and request.output == "table" and request.save_plan is None
    assert request.policy.allow == {"exact", "bf16_autocast"}
    assert request.sample == {}  # the model's own sample: 8 x 1024


@pytest.mark.parametrize(("group", "name"), _group_files(), ids=lambda v: str(v))
def test_every_group_yaml_composes_and_validates(group, name):
    overrides = [f"{group}={name}"]
    if group == "training":
        overrides.append(f"model={TRAINING_MODEL}")
    cfg = compose_plan_config(overrides)
    assert cfg[group] is not None
    assert validate(cfg) == [], overrides


def test_base_yaml_composes_and_asks_for_a_model():
    cfg = compose_plan_config(config_name="base")
    problems = validate(cfg)
    assert any(p.startswith("no model: choose one with model=<name>") for p in problems)
    # the schema's hardware is `auto` (the local GPU): without one, it says what to name instead
    assert all(p.startswith(("no model", "hardware: hardware='auto' needs a local GPU")) for p in problems)


def test_model_yamls_use_sample_not_defaults():
    # a top-level `defaults:` in a group file is Hydra's defaults list; the typical sample is `sample:`
    for path in sorted((configs_dir() / "model").glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        assert "defaults" not in data and isinstance(data.get("sample"), dict), path.name


def test_schema_follows_the_planner():
    assert [f.name for f in dataclasses.fields(PinsConfig)] == list(PINNABLE)
    assert [f.name for f in dataclasses.fields(ForbidConfig)] == [*PINNABLE, "loss_scaling"]
    assert {f.name for f in dataclasses.fields(HardwareConfig)} == {f.name for f in dataclasses.fields(HardwareSpec)}


def test_overrides_reach_the_request():
    cfg = compose_plan_config(["model=llama3_8b", "budget=40GB", "training.batch_size=8", "training.seq_len=4096",
                               "hardware=h200", "policy=8bit", "policy.pins.checkpointing=full",
                               "policy.forbid.optimizer=[paged_adamw8bit]", "policy.margin=1GiB",
                               "training.optimizer_kwargs.lr=1e-5"])
    request = resolve(cfg)
    assert request.budget_bytes == 40 * 10**9 and request.hardware.name == "h200"
    assert request.sample == {"batch_size": 8, "seq_len": 4096}
    assert "8bit_optimizer" in request.policy.allow and request.policy.pins == {"checkpointing": "full"}
    assert request.policy.forbid == {"optimizer": ("paged_adamw8bit",)} and request.policy.margin(0) == 1 << 30
    assert request.optimizer_kwargs == {"lr": 1e-5}


def test_training_optimizer_pins_it():
    request = resolve(compose_plan_config(["training=sgd", "model=vit_base"]))
    assert request.policy.pins["optimizer"] == "sgd" and request.optimizer_kwargs["momentum"] == 0.9
    problems = validate(compose_plan_config(["training.optimizer=sgd", "policy.pins.optimizer=adamw_fused"]))
    assert problems == ["training.optimizer=sgd contradicts policy.pins.optimizer=adamw_fused; set one of them"]


def test_variable_length_batches_are_planned_for_the_longest():
    request = resolve(compose_plan_config(["model=llama32_1b", "training=finetune"]))
    assert request.sample == {"batch_size": 8, "seq_len": 2048, "variable_length": True}


def test_plain_dict_configs_validate_too():
    problems = validate({"model": {"name": "x"}, "budget": "40 gigs", "output": "xml"})
    assert any("unknown unit 'gigs'" in p for p in problems)
    assert any("output='xml' is not one of table, json" in p for p in problems)
    assert any(p.startswith("model: invalid model spec 'x'") for p in problems)
    with pytest.raises(ConfigError, match="unknown key 'budgit'"):
        resolve({"budgit": "1GB"})


def test_hardware_can_be_written_out_or_adjusted():
    request = resolve(compose_plan_config(["hardware=a100_80gb", "hardware.memory_bytes=48GiB", "budget=90%"]))
    assert request.hardware.memory_bytes == 48 << 30 and request.budget_bytes == int(0.9 * (48 << 30))
    problems = validate(compose_plan_config(["hardware=auto"]))  # no GPU in CI: says what to do instead
    assert len(problems) == 1 and "hardware=h100_80gb" in problems[0]


def test_user_module_target():
    cfg = compose_plan_config(["~model", "+model._target_=torch.nn.Linear", "+model.kwargs.in_features=16",
                               "+model.kwargs.out_features=4", "+model.inputs.input=[16]",
                               "training.batch_size=32"])
    request = resolve(cfg)
    assert request.model == {"_target_": "torch.nn.Linear", "in_features": 16, "out_features": 4}
    assert tuple(request.sample["input"].shape) == (32, 16) and request.sample["input"].device.type == "meta"
    problems = validate(compose_plan_config(["~model", "+model._target_=no.such.Module"]))
    assert any("model._target_='no.such.Module' cannot be imported" in p for p in problems)
    assert any("model.inputs is required" in p for p in problems)
    # a _target_ added on top of the default model: the problem names the '~model' that drops it
    problems = validate(compose_plan_config(["+model._target_=torch.nn.Linear", "+model.inputs.input=[16]",
                                             "training.batch_size=32"]))
    assert len(problems) == 1 and "both _target_ and spec keys" in problems[0] and "'~model' first" in problems[0]


# -- bad input: every problem at once, each naming what would be valid --------------------------------------------


def test_unknown_names_suggest_the_closest():
    problems = diagnose(["model=llama3_8", "hardware=h100", "policy=8bits", "training=pretrian"])
    assert len(problems) == 4, problems
    assert problems[0].startswith("unknown model 'llama3_8' (did you mean 'llama3_8b'?); shipped: bert_base")
    assert "unknown hardware spec 'h100'" in problems[1] and "h100_80gb" in problems[1]
    assert "unknown policy '8bits' (did you mean '8bit'?)" in problems[2]
    assert "unknown training preset 'pretrian' (did you mean 'pretrain'?)" in problems[3]


def test_unknown_keys_list_the_valid_ones():
    problems = diagnose(["training.batchsize=8", "policy.pins.foo=1", "budgt=1GB", "model.hf_config.n_layers=2"])
    assert problems[0] == ("unknown key 'training.batchsize' (did you mean 'batch_size'?); valid keys of training: "
                           "batch_size, seq_len, image_size, decoder_seq_len, variable_length, optimizer, "
                           "optimizer_kwargs")
    assert problems[1].startswith("cannot pin unknown technique 'foo'; pinnable: precision, checkpointing")
    assert problems[2].startswith("unknown key 'budgt' (did you mean 'budget'?); valid top-level keys: model")
    assert "model.hf_config has no field 'n_layers' (did you mean 'n_layer'?)" in problems[3]
    assert "+model.hf_config.n_layers=" in problems[3]


def test_every_problem_is_reported_at_once():
    problems = diagnose(["model=gpt3", "training.batch_size=abc", "budget=40 gigs", "policy.fidelity=fast",
                         "policy.pins.precision=fp17", "output=xml"])
    text = "\n".join(problems)
    for part in ("unknown model 'gpt3'", "training.batch_size: Value 'abc'", "unknown unit 'gigs'",
                 "unknown fidelity 'fast'", "pin precision='fp17': valid values are 'fp32'",
                 "output='xml' is not one of table, json"):
        assert part in text, text


def test_contradictory_pins():
    problems = diagnose(["policy=mixed", "policy.pins.precision=fp16_autocast",
                         "policy.forbid.loss_scaling=[grad_scaler]"])
    assert problems and all(p.startswith("policy: ") for p in problems)
    assert any("fp16 training needs a gradient scaler; pin bf16_autocast instead" in p for p in problems)
    problems = validate(compose_plan_config(["policy.pins.precision=fp16_autocast"]))  # default fidelity
    assert problems == ["policy: pinning precision='fp16_autocast' needs fidelity allowance 'mixed_precision', "
                        "which the policy does not allow (allowed: bf16_autocast, exact)"]


def test_budget_below_the_cuda_context():
    problems = validate(compose_plan_config(["budget=500MB"]))
    assert len(problems) == 1
    assert problems[0].startswith("budget 500MB (476.84 MiB) is below what the CUDA runtime alone holds on h100_80gb")
    assert "give at least" in problems[0]


def test_shapes_are_checked_against_the_model():
    problems = validate(compose_plan_config(["model=vit_base", "training.seq_len=512", "training.batch_size=0"]))
    assert len(problems) == 1 and problems[0].startswith("training: invalid training shapes for model 'vit_base'")
    assert "batch_size must be a positive int" in problems[0] and "seq_len does not apply" in problems[0]
    problems = validate(compose_plan_config(["model=gpt2", "training.seq_len=2048"]))
    assert "seq_len 2048 exceeds" in problems[0] and "(n_positions=1024)" in problems[0]
    problems = validate(compose_plan_config(["policy.pins.micro_batch_size=3"]))
    assert problems == ["policy.pins.micro_batch_size=3 does not divide the global batch 8 (training.batch_size); "
                        "use one of 1, 2, 4, 8"]


def test_bad_override_grammar_and_primary_config():
    assert diagnose(["budget=["])[0].startswith("cannot read the override 'budget=['")
    problems = diagnose([], config_name="llama3_8b_full_ft", config_dir=RECIPES)
    assert problems[0].startswith("no config named 'llama3_8b_full_ft' (did you mean 'llama3_8b_full_ft_h100'?)")


def test_sweeps_are_checked_per_value():
    problems = diagnose(["budget=16GB,4 gigs", "model=gpt2,gtp2"])
    assert any("unknown model 'gtp2' (did you mean 'gpt2'?)" in p for p in problems)
    assert any(p.startswith("budget=4 gigs: unknown unit 'gigs'") for p in problems)


# -- recipes ----------------------------------------------------------------------------------------------------


def test_required_recipes_are_shipped():
    assert {"llama3_8b_full_ft_h100", "qwen2_7b_24gb", "gpt2_pretrain_16gb", "vit_base_t4",
            "bert_large_a100_40gb", "llama3_8b_qlora_12gb", "llama3_8b_qlora_24gb", "llama3_8b_lora_40gb"
            } <= set(_recipes())


@pytest.mark.parametrize("name", _recipes())
def test_recipe_composes_and_validates(name):
    header = (RECIPES / f"{name}.yaml").read_text()
    assert f"python -m memopt.plan --config-dir recipes --config-name {name}\n" in header, "documented command"
    cfg = compose_plan_config(config_name=name, config_dir=RECIPES)
    assert validate(cfg) == []


# The Qwen2-7B recipe is the card that is too small by design: it must say so and by how much.
_EXPECT_FIT = {"qwen2_7b_24gb": False}
# Cold-cache plan times on the 2-core CPU (user CPU seconds, including ~7 s of imports): gpt2_pretrain_16gb 34,
# vit_base_t4 20, bert_large_a100_40gb 19, qwen2_7b_24gb 232 (16 layers: 180; the search, not the depth, costs),
# llama3_8b_full_ft_h100 110 (4 layers: 38). Only Llama is planned with fewer layers (2: the plan's search and
# traces are what is checked, and each traced layer costs the same); the rest at full size.
_REDUCED = {name: ["model.hf_config.num_hidden_layers=2"] for name in (
    "llama3_8b_full_ft_h100", "llama3_8b_qlora_12gb", "llama3_8b_qlora_24gb", "llama3_8b_lora_40gb")}


@pytest.mark.slow
@pytest.mark.parametrize("name", _recipes())
def test_recipe_plans(name):
    request = resolve(compose_plan_config(_REDUCED.get(name, []), config_name=name, config_dir=RECIPES))
    plan = request.plan()
    assert plan.fits is _EXPECT_FIT.get(name, True), plan.infeasible
    if plan.fits:
        assert plan.total_bytes + plan.margin_bytes <= plan.budget_bytes
        assert plan.step_time_s > 0 and plan.search["evaluated"] >= 1
    else:
        assert "with every allowed technique" in plan.infeasible["message"]
        assert plan.infeasible["smallest_total_bytes"] > plan.budget_bytes
