"""Keys added with ``+`` on the command line are checked as the same keys without ``+``, and an error raised
while building the model is reported with its root cause, on one line."""

from __future__ import annotations

import pytest

from memopt.config import compose_plan_config, diagnose, resolve, validate
from memopt.config.validate import ConfigError
from memopt.plan.__main__ import EXIT_BAD_INPUT, main, unexpected

BASE = ["model=tiny_llama", "hardware=h100_80gb", "budget=8GB", "training.batch_size=8", "training.seq_len=32"]


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MEMOPT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "plus-keys-cache"))


def cli(args: list[str], capsys, base: tuple[str, ...] | list[str] = BASE) -> tuple[int, list[str], str]:
    """(exit status, the problems listed on stderr, everything printed)."""
    code = main([*base, *args])
    captured = capsys.readouterr()
    problems = [line[4:] for line in captured.err.splitlines() if line.startswith("  - ")]
    return code, problems, captured.out + captured.err


@pytest.mark.parametrize(("key", "meant"), [
    ("training.lr=-1", "training.optimizer_kwargs.lr"),
    ("pins.micro_batch_size=3", "policy.pins"),
    ("fidelity=lossy", "policy.fidelity"),
    ("training.optimizer_kwargs.lrr=0.1", "lr"),
])
def test_an_unknown_plus_key_is_refused_as_without_plus(key, meant, capsys):
    code, problems, out = cli([f"+{key}"], capsys)
    assert code == EXIT_BAD_INPUT and "Traceback" not in out, out
    assert len(problems) == 1 and f"(did you mean {meant!r}?)" in problems[0], out
    assert problems == diagnose([*BASE, key]), "the same key without '+' must read the same"


def test_every_unknown_plus_key_is_reported_with_the_other_problems():
    problems = validate(compose_plan_config(["+training.lr=1", "+bogus=1", "budget=3 gigs"]))
    assert len(problems) == 3, problems
    assert problems[0].startswith("unknown key 'training.lr'") and problems[1].startswith("unknown key 'bogus'")
    assert "unknown unit 'gigs'" in problems[2]


def test_a_plain_dict_and_a_composed_config_refuse_alike():
    composed = compose_plan_config(["+training.optimizer_kwargs.lrr=0.1"])
    cfg = {"model": {"name": "tiny_llama"}, "training": {"optimizer_kwargs": {"lrr": 0.1}}}
    with pytest.raises(ConfigError) as from_dict:
        resolve(cfg)
    assert cfg["training"]["optimizer_kwargs"] == {"lrr": 0.1}, "the caller's config is left as it was"
    assert validate(composed) == [from_dict.value.problems[0]]
    assert from_dict.value.problems[0].startswith("unknown key 'training.optimizer_kwargs.lrr' (did you mean 'lr'?)")


def test_plus_on_a_key_that_has_a_value_says_what_to_write(capsys):
    code, problems, out = cli(["+policy.fidelity=lossy"], capsys)
    assert code == EXIT_BAD_INPUT
    assert problems == ["policy.fidelity already has a value and '+' only adds keys: write policy.fidelity=lossy "
                        "to change it"], out


def test_a_target_kwarg_the_model_does_not_take_names_the_type_error(capsys):
    code, problems, out = cli(["~model", "+model._target_=torch.nn.Linear", "+model.kwargs.in_feature=8",
                               "+model.kwargs.out_features=2", "+model.inputs={x: {shape: [8]}}"], capsys,
                              base=["hardware=h100_80gb", "budget=8GB", "training.batch_size=4"])
    assert code == EXIT_BAD_INPUT and "Traceback" not in out, out
    assert len(problems) == 1 and "\n" not in problems[0], out
    assert "model._target_='torch.nn.Linear'" in problems[0]
    assert "unexpected keyword argument 'in_feature'" in problems[0], out


def test_an_hf_config_transformers_refuses_names_the_reason(capsys):
    code, problems, out = cli(["model.hf_config.num_attention_heads=3"], capsys)
    assert code == EXIT_BAD_INPUT and "Traceback" not in out, out
    assert len(problems) == 1 and problems[0].startswith("model.hf_config is not a valid config for"), out
    assert "is not a multiple of the number of attention heads (3)" in problems[0], out


def test_an_unexpected_error_shows_its_root_cause_on_one_line():
    try:
        try:
            int("twelve")
        except ValueError as inner:
            raise RuntimeError("Error in call to target 'pkg.Net':\nsee above") from inner
    except RuntimeError as exc:
        line = unexpected(exc)
    assert "\n" not in line and line.startswith("unexpected error RuntimeError: Error in call to target 'pkg.Net'")
    assert "ValueError: invalid literal for int() with base 10: 'twelve'" in line


def test_a_save_plan_path_that_cannot_be_written_is_one_line(tmp_path, capsys):
    code, problems, out = cli([f"save_plan={tmp_path}"], capsys)
    assert code == EXIT_BAD_INPUT and "Traceback" not in out, out
    assert len(problems) == 1 and problems[0].startswith(f"save_plan={str(tmp_path)!r}: cannot write the plan"), out
    assert "Is a directory" in problems[0] and "unexpected error" not in problems[0]


def _mean_square(output, batch):
    """(output, batch) -> loss, for a model that returns its logits."""
    return output.float().pow(2).mean()


OWN_MODULE = ["~model", "+model._target_=torch.nn.Linear", "+model.kwargs.in_features=16",
              "+model.kwargs.out_features=4", "+model.inputs={input: {shape: [16]}}", "hardware=h100_80gb",
              "budget=8GB", "training.batch_size=8"]


def test_messages_name_the_command_lines_keys_and_the_named_key_works(capsys, monkeypatch):
    """A model that returns logits was told to "pass loss_fn=... to memopt.wrap" and a small budget to set
    "margin=3%": both Python arguments; the command line's keys are +model.loss_fn and policy.margin."""
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    code, problems, out = cli([], capsys, base=OWN_MODULE)
    assert code == EXIT_BAD_INPUT and len(problems) == 1, out
    assert "+model.loss_fn=<module>.<function>" in problems[0]
    code, problems, out = cli(["+model.loss_fn=test_cli_plus_keys._mean_square"], capsys, base=OWN_MODULE)
    assert code == 0 and not problems, out
    code, problems, out = cli(["budget=40MB"], capsys)
    assert code == EXIT_BAD_INPUT and any("policy.margin=3%" in p for p in problems), out
