"""One validation layer for the CLI and the Python API: each bad input of issue 21 is refused by both, with one
line that names what was wrong and what would work; the CLI exits 2 (never 1, never a traceback)."""

from __future__ import annotations

import json

import pytest

import memopt
from memopt.errors import InputError
from memopt.models import build_model
from memopt.plan import Plan
from memopt.plan.__main__ import EXIT_BAD_INPUT, EXIT_OK, main
from memopt.plan.checks import check_pins_honoured, model_fingerprint
from memopt.plan.planner import make_plan
from memopt.strategy import Strategy

SAMPLE = {"batch_size": 8, "seq_len": 32}
BASE = ["model=tiny_llama", "hardware=h100_80gb", "budget=8GB", "training.batch_size=8", "training.seq_len=32"]


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MEMOPT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "validation-cache"))


def cli(args: list[str], capsys) -> tuple[int, str]:
    code = main([*BASE, *args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


# (API keyword arguments, CLI overrides, words the one-line message must contain)
CASES = [
    ({"budget": "1e400"}, ["budget=1e400"], ("budget", "too large")),
    ({"budget": -5}, ["budget=-5"], ("budget", "negative")),
    ({"budget": 0}, ["budget=0"], ("zero",)),
    ({"pins": {"micro_batch_size": 16}}, ["+policy.pins.micro_batch_size=16"], ("16", "global batch 8", "1, 2, 4, 8")),
    ({"pins": {"micro_batch_size": 3}}, ["+policy.pins.micro_batch_size=3"], ("3", "does not divide", "1, 2, 4, 8")),
    ({"policy": {"margin": "200%"}}, ["policy.margin=200%"], ("margin", "below 100%")),
    ({"hardware": "h100"}, ["hardware=h100"], ("h100_80gb",)),
    ({"nvme_path": "/no/such/dir"}, ["hardware.extra.nvme_path=/no/such/dir"], ("/no/such/dir", "does not exist")),
    ({"calibration": "ignor"}, ["calibration=ignor"], ("ignore",)),
    ({"pins": {"checkpointing": "none", "checkpoint_blocks": 1}},
     ["+policy.pins.checkpointing=none", "+policy.pins.checkpoint_blocks=1"],
     ("checkpointing='none' and checkpoint_blocks=1 contradict", "checkpointing='full'")),
    ({"pins": {"checkpointing": "full", "checkpoint_blocks": 0}},
     ["+policy.pins.checkpointing=full", "+policy.pins.checkpoint_blocks=0"],
     ("checkpoint_blocks=0 contradict", "checkpointing='none'")),
]


@pytest.mark.parametrize(("kwargs", "overrides", "words"), CASES, ids=[c[1][0] for c in CASES])
def test_the_api_and_the_cli_refuse_alike(kwargs, overrides, words, capsys):
    with pytest.raises(ValueError) as info:
        make_plan("tiny_llama", SAMPLE, **{"budget": "8GB", "hardware": "h100_80gb", **kwargs})
    message = str(info.value)
    assert "\n" not in message and all(w in message for w in words), message
    code, out = cli(overrides, capsys)
    assert code == EXIT_BAD_INPUT, out
    assert "Traceback" not in out and all(w in out for w in words), out


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"world_size": 0}, ("world_size=0", "positive integer")),
    ({"world_size": -1}, ("world_size=-1",)),
    ({"world_size": "8"}, ("without quotes",)),
    ({"nodes": 0}, ("nodes=0",)),
    ({"world_size": 6, "nodes": 4}, ("multiple of nodes=4",)),
    ({"optimizer": "adamww"}, ("did you mean 'adamw'",)),
])
def test_api_only_arguments(kwargs, words):
    with pytest.raises(InputError) as info:
        make_plan("tiny_llama", SAMPLE, budget="8GB", hardware="h100_80gb", **kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_wrap_checks_hyperparameters_and_shares_the_messages():
    model = build_model("tiny_llama", device="cpu")
    for kwargs, words in (({"lr": "fast"}, ("lr='fast'", "1e-4")), ({"optimizer": "adamww"}, ("adamw",)),
                          ({"pins": {"micro_batch_size": 3}}, ("does not divide",)),
                          ({"betas": (0.9, 1.5)}, ("betas[1]",)), ({"budget": "1e400"}, ("too large",))):
        with pytest.raises(ValueError) as info:
            memopt.wrap(model, **{"budget": "8GB", "sample": SAMPLE, "hardware": "h100_80gb", **kwargs})
        assert all(w in str(info.value) for w in words), str(info.value)


def test_model_yaml_key_typos_are_refused(capsys, tmp_path):
    code, out = cli(["+model.hf_config.hiden_size=8"], capsys)
    assert code == EXIT_BAD_INPUT and "hiden_size" in out and "did you mean 'hidden_size'" in out
    spec = {"name": "t", "family": "causal_lm", "architecture": "LlamaForCausalLM",
            "hf_config": {"model_type": "llama", "hiden_size": 64, "num_hidden_layers": 1}}
    with pytest.raises(ValueError, match="hidden_size"):
        make_plan(spec, {"batch_size": 2, "seq_len": 8}, budget="8GB", hardware="h100_80gb")


def test_a_size_or_count_that_is_not_positive_is_refused_before_the_model_is_built(capsys):
    code, out = cli(["model.hf_config.hidden_size=-64"], capsys)
    assert code == EXIT_BAD_INPUT and "model.hf_config.hidden_size=-64 must be a positive integer" in out, out
    assert "unexpected error" not in out
    spec = {"name": "t", "family": "causal_lm", "architecture": "LlamaForCausalLM",
            "hf_config": {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 0}}
    with pytest.raises(ValueError, match=r"num_hidden_layers=0 must be a positive integer"):
        make_plan(spec, {"batch_size": 2, "seq_len": 8}, budget="8GB", hardware="h100_80gb")


def test_documented_nvme_key_works_without_plus(capsys, tmp_path):
    code, out = cli([f"hardware.extra.nvme_path={tmp_path}"], capsys)
    assert code == EXIT_OK, out


def test_saved_plans_carry_a_fingerprint_and_every_field_is_checked(tmp_path):
    plan = make_plan("tiny_llama", SAMPLE, budget="8GB", hardware="h100_80gb")
    llama = build_model("tiny_llama", device="cpu")
    assert plan.model["fingerprint"] == model_fingerprint(llama)
    path = plan.save(tmp_path / "plan.json")
    gpt2 = build_model("tiny_gpt2", device="cpu")
    with pytest.raises(ValueError, match="another model"):
        memopt.wrap(gpt2, plan=path)
    memopt.wrap(gpt2, plan=path, allow_plan_mismatch=True).close()  # the user's override
    with pytest.raises(ValueError, match="global batch of 8"):
        memopt.wrap(llama, plan=path, sample={"batch_size": 4, "seq_len": 32})
    data = json.loads(path.read_text())
    for edit, words in ((("precision", "fp8"), "techniques.precision='fp8'"),
                        (("micro_batch_size", 0), "micro_batch_size=0"),
                        (("optimizer", "adamww"), "techniques.optimizer"),
                        (("grad_accum_steps", 3), "is not the global batch")):
        bad = json.loads(json.dumps(data))
        bad["techniques"][edit[0]] = edit[1]
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace("[", r"\[")):
            Plan.from_dict(bad)
    bad = {**data, "budget_bytes": -1}
    with pytest.raises(ValueError, match="budget_bytes"):
        Plan.from_dict(bad)


def test_a_pin_an_offload_plan_cannot_honour_is_refused():
    plan = make_plan("tiny_llama", SAMPLE, budget="8GB", hardware="h100_80gb")
    offload = Plan(**{**plan.__dict__, "strategy": plan.strategy.replace(
        chunked_ce=0, extras=(("sharding", {"stage": 3}),))})
    check_pins_honoured(offload, {"chunked_ce": 0})  # honoured: fine
    with pytest.raises(InputError, match="chunked_ce=4 cannot be honoured by the offload plan"):
        check_pins_honoured(offload, {"chunked_ce": 4})
    with pytest.raises(InputError, match="optimizer='sgd'"):
        check_pins_honoured(Plan(**{**plan.__dict__, "strategy": Strategy(optimizer="adamw_fused",
                                                                           micro_batch_size=8)}),
                            {"optimizer": "sgd"})


def test_unexpected_errors_exit_2_with_one_line(capsys, monkeypatch):
    import sys

    validate = sys.modules["memopt.config.validate"]

    def broken(self):
        raise KeyError("something memopt did not expect")

    monkeypatch.setattr(validate.PlanRequest, "plan", broken)
    code, out = cli([], capsys)
    assert code == EXIT_BAD_INPUT and "Traceback" not in out
    assert "unexpected error KeyError" in out and "please report it" in out


def test_the_default_hardware_is_the_same_everywhere_and_said():
    """Not given: the local GPU, else h100_80gb with a note (no GPU here); 'auto': an error without a GPU."""
    plan = make_plan("tiny_llama", SAMPLE, budget="8GB")
    assert plan.hardware == "h100_80gb" and any("no GPU visible: planned for h100_80gb" in n for n in plan.notes)
    assert memopt.profile("tiny_llama", SAMPLE).key == memopt.profile("tiny_llama", SAMPLE, hardware="h100_80gb").key
    with pytest.raises(ValueError, match="needs a local GPU"):
        make_plan("tiny_llama", SAMPLE, budget="8GB", hardware="auto")
    for name in ("MemoptOOMError", "MemoptLeakError", "InputError"):
        assert name in memopt.__all__ and hasattr(memopt, name)


def test_the_entry_points_show_their_parameters_and_typed_returns():
    """``memopt.plan``, ``memopt.profile`` and ``memopt.estimate`` are modules that are called: help() and
    ``inspect.signature`` show the function they call, not ``(*args, **kwargs) -> Any``."""
    import inspect

    from memopt.apply.wrapped import Wrapped

    returns = {name: inspect.signature(getattr(memopt, name)).return_annotation for name in ("plan", "profile",
                                                                                             "estimate")}
    assert returns == {"plan": memopt.Plan, "profile": memopt.Profile, "estimate": memopt.Estimate}
    assert "Wrapped" in str(inspect.signature(memopt.wrap).return_annotation) and Wrapped is memopt.Wrapped
    assert list(inspect.signature(memopt.plan).parameters)[:3] == ["model", "sample", "budget"]
