"""``python -m memopt.plan``: the dry run as a user runs it (a subprocess), its exit status and its output.

The fast tier runs the bundled default once (GPT-2, 8 x 1024; its profile is traced into a cache shared by
this module's runs), the JSON form against that cache, and bad input (no planning). Multirun, the infeasible
example and a recipe on the command line are slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest
from rich.console import Console

from memopt.cli_render import describe_sample, render_plan
from memopt.plan import Plan

REPO = Path(__file__).resolve().parents[2]
REQUIRED_KEYS = ("peak_allocated_bytes", "peak_reserved_bytes", "total_bytes", "budget_bytes", "step_time_s",
                 "techniques", "breakdown", "runners_up", "search")


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory) -> dict[str, str]:
    """The environment of every CLI run here: one profile cache for the module, in a temporary folder."""
    env = dict(os.environ)
    env["MEMOPT_CACHE_DIR"] = str(tmp_path_factory.mktemp("cli-cache"))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["TRANSFORMERS_VERBOSITY"] = "error"
    env.pop("HYDRA_FULL_ERROR", None)
    return env


def run_cli(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memopt.plan", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _no_traceback(proc: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, proc.stderr[-3000:]


# -- the bundled default -----------------------------------------------------------------------------------------


def test_no_arguments_plans_the_bundled_default(cli_env, tmp_path):
    proc = run_cli([], cli_env, tmp_path)
    _no_traceback(proc)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for part in ("memopt plan", "gpt2 (GPT2LMHeadModel", "8 x 1024 tokens per step", "h100_80gb", "24GB = 22.35 GiB",
                 "FITS", "Chosen techniques", "precision", "activation checkpointing", "micro-batching", "saves",
                 "costs per step", "Memory at the peak", "total predicted", "safety margin", "headroom",
                 "Step time", "tokens/s", "Runners-up", "Why the other choices lost", "candidates", "evaluated",
                 "pruned as slower"):
        assert part in out, (part, out)
    assert not list(tmp_path.iterdir()), "a single run writes nothing to the working directory"


def test_json_output_is_the_plan(cli_env, tmp_path):
    saved = tmp_path / "plans" / "plan.json"
    proc = run_cli(["output=json", f"save_plan={saved}"], cli_env, tmp_path)
    _no_traceback(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)  # nothing but the JSON on stdout
    for key in REQUIRED_KEYS:
        assert key in data, key
    assert data["fits"] is True and data["budget_bytes"] == 24 * 10**9
    assert data["total_bytes"] + data["margin_bytes"] <= data["budget_bytes"]
    assert data["model"]["name"] == "gpt2" and data["model"]["sample"]["batch_size"] == 8
    assert {"candidates", "evaluated"} <= set(data["search"])
    plan = Plan.load(saved)
    assert plan.fits and plan.techniques == data["techniques"] and plan.total_bytes == data["total_bytes"]


def test_help_lists_the_groups(cli_env, tmp_path):
    proc = run_cli(["--help"], cli_env, tmp_path)
    assert proc.returncode == 0
    for part in ("python -m memopt.plan", "model: ", "hardware: ",
                 "policy: 8bit, default, exact, lora, lossy, mixed, qlora", "training: ", "Exit status"):
        assert part in proc.stdout, part


# -- bad input: exit 2, every problem, what would work -------------------------------------------------------------


def test_bad_names_exit_2_with_what_would_work(cli_env, tmp_path):
    proc = run_cli(["budget=40 gigs", "model=llama3_8", "hardware=h100", "policy.pins.foo=1"], cli_env, tmp_path)
    _no_traceback(proc)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = " ".join(proc.stderr.split())  # rich may wrap long lines
    assert proc.stdout == ""
    assert "unknown unit 'gigs' in budget '40 gigs'" in err and "'40GiB'" in err
    assert "unknown model 'llama3_8' (did you mean 'llama3_8b'?)" in err
    assert "unknown hardware spec 'h100'" in err and "h100_80gb" in err
    assert "cannot pin unknown technique 'foo'; pinnable: precision, checkpointing" in err


def test_a_policy_that_forbids_every_candidate_exits_2_before_planning(cli_env, tmp_path):
    proc = run_cli(["policy.forbid.precision=[fp32,bf16_autocast]",
                    "policy.forbid.optimizer=[adamw_fused,adamw_foreach,adamw,sgd]"], cli_env, tmp_path)
    _no_traceback(proc)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = " ".join(proc.stderr.split())
    assert proc.stdout == ""
    assert "the policy leaves no precision to plan on h100_80gb" in err and "bf16_pure needs 'lossy'" in err
    assert "the policy leaves no optimizer to plan on h100_80gb" in err and "need '8bit_optimizer'" in err


def test_a_mistyped_policy_is_one_line_naming_the_key_without_hydras_line(cli_env, tmp_path):
    for args, expected in ((["policy.fidelity=5"], "policy: fidelity must be a preset"),
                           (["model=tiny_gpt2", "training.batch_size=2", "policy.forbid.micro_batch_size=[1,2]"],
                            "the policy leaves no micro_batch_size for the batch of 2")):
        proc = run_cli(args, cli_env, tmp_path)
        _no_traceback(proc)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "Error executing job" not in proc.stderr and "unexpected error" not in proc.stderr, proc.stderr
        assert expected in " ".join(proc.stderr.split()), proc.stderr


def test_contradictions_tiny_budgets_and_bad_shapes_exit_2(cli_env, tmp_path):
    proc = run_cli(["policy=mixed", "policy.pins.precision=fp16_autocast", "policy.forbid.loss_scaling=[grad_scaler]",
                    "budget=500MB", "training.seq_len=4096", "training.batchsize=8"], cli_env, tmp_path)
    _no_traceback(proc)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = " ".join(proc.stderr.split())
    assert "fp16 training needs a gradient scaler; pin bf16_autocast instead" in err
    assert "budget 500MB (476.84 MiB) is below what the CUDA runtime alone holds on h100_80gb" in err
    assert "give at least" in err
    assert "unknown key 'training.batchsize' (did you mean 'batch_size'?)" in err
    assert "seq_len 4096 exceeds" in err and "n_positions=1024" in err


# -- no fit: exit 3 and what would -------------------------------------------------------------------------------


@pytest.mark.slow
def test_infeasible_budget_exits_3_with_the_reason(cli_env, tmp_path):
    proc = run_cli(["model=llama32_1b", "budget=2GB", "training.batch_size=8", "training.seq_len=2048"],
                   cli_env, tmp_path, timeout=900)
    _no_traceback(proc)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = " ".join(proc.stdout.split())
    assert "DOES NOT FIT" in out and "with every allowed technique" in out
    # 8-bit states still leave 1.24 B parameters' fp32 weights and gradients (10 GB): the trace-free floor says so
    assert "allowing 8bit_optimizer still needs at least" in out and "What allowing more would reach" in out
    assert "model states alone" in out


@pytest.mark.slow
def test_infeasible_json_exits_3(cli_env, tmp_path):
    # the smallest model: the CUDA runtime and the safety margin alone exceed 1 GB
    proc = run_cli(["model=tiny_gpt2", "budget=1GB", "output=json"], cli_env, tmp_path)
    _no_traceback(proc)
    assert proc.returncode == 3, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    assert data["fits"] is False and "with every allowed technique" in data["infeasible"]["message"]
    assert "does not fit: needs" in " ".join(proc.stderr.split())


@pytest.mark.parametrize("output", ["table", "json"])
def test_run_exit_status_follows_the_plan(monkeypatch, capsys, tmp_path, output):
    # in-process, with the planner replaced by a known plan: the exit status and what is printed where
    from memopt.config import compose_plan_config
    from memopt.config.validate import PlanRequest
    from memopt.plan.__main__ import run

    for fits, code in ((True, 0), (False, 3)):
        monkeypatch.setattr(PlanRequest, "plan", lambda self, fits=fits: Plan.from_dict(_plan_dict(fits)))
        saved = tmp_path / f"{output}-{fits}.json"
        assert run(compose_plan_config([f"output={output}", f"save_plan={saved}"])) == code
        out, err = capsys.readouterr()
        assert Plan.load(saved).fits is fits
        if output == "json":
            assert json.loads(out)["fits"] is fits
            assert ("does not fit: needs 50.00 GiB" in err) is not fits
        else:
            assert ("FITS" if fits else "DOES NOT FIT") in out and f"plan saved to {saved}" in out
    assert run(compose_plan_config(["budget=lots"])) == 2
    assert "cannot read budget 'lots'" in " ".join(capsys.readouterr().err.split())


# -- multirun, recipes -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_multirun_one_plan_per_budget(cli_env, tmp_path):
    proc = run_cli(["-m", "budget=16GB,24GB"], cli_env, tmp_path)
    _no_traceback(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("FITS") == 2
    assert "job 0: budget=16GB" in proc.stdout and "job 1: budget=24GB" in proc.stdout
    plans = sorted(tmp_path.glob("multirun/*/*/*/plan.json"))
    assert [Plan.load(p).budget_bytes for p in plans] == [16 * 10**9, 24 * 10**9]
    assert not (tmp_path / "outputs").exists()


@pytest.mark.slow
def test_recipe_from_the_command_line(cli_env, tmp_path):
    proc = run_cli(["--config-dir", str(REPO / "recipes"), "--config-name", "bert_large_a100_40gb", "output=json"],
                   cli_env, tmp_path, timeout=900)
    _no_traceback(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    assert data["model"]["name"] == "bert_large" and data["hardware"] == "a100_40gb"
    assert data["global_batch"] == 64 and data["budget_bytes"] == 38 << 30


@pytest.mark.slow
def test_variable_length_batches_are_noted(cli_env, tmp_path):
    proc = run_cli(["model=tiny_llama", "training.variable_length=true", "output=json"], cli_env, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    assert data["model"]["sample"]["variable_length"] is True
    assert any("batches vary in length: planned for the longest" in n for n in data["notes"])


# -- the rendering alone (no Hydra, no planning) ---------------------------------------------------------------------


def _plan_dict(fits: bool) -> dict:
    techniques = {"precision": "bf16_autocast", "checkpointing": {"mode": "full", "num_blocks": 12},
                  "activation_offload": False, "attention": "auto", "chunked_ce": 8, "optimizer": "adamw8bit",
                  "micro_batch_size": 2, "grad_accum_steps": 4, "expandable_segments": True, "extras": {}}
    prediction = {"peak_allocated_bytes": 30 << 30, "peak_reserved_bytes": 32 << 30, "runtime_bytes": 800 << 20,
                  "total_bytes": (32 << 30) + (800 << 20), "step_time_s": 1.5, "tokens_per_s": 21845.3,
                  "forward_s": 0.5, "backward_s": 0.9, "optimizer_s": 0.1, "peak_at": "step 2, backward",
                  "breakdown": {"parameters": 16 << 30, "optimizer_states": 4 << 30, "activations": 10 << 30,
                                "temporaries": 1 << 30, "allocator_overhead": 1 << 30, "runtime": 800 << 20}}
    return {"schema_version": 1, "fits": fits, "techniques": techniques, "budget_bytes": 40 * 10**9,
            "margin_bytes": 1 << 30, "prediction": prediction, "hardware": "h100_80gb",
            "model": {"name": "llama3_8b", "class": "LlamaForCausalLM", "num_params": 8_030_261_248,
                      "num_trainable_params": 8_030_261_248,
                      "sample": {"batch_size": 8, "seq_len": 4096, "variable_length": True}},
            "policy": {"allow": ["exact", "bf16_autocast", "8bit_optimizer"], "pins": {"checkpointing": "full"},
                       "forbid": {}},
            "global_batch": 8,
            "runners_up": [{"label": "bf16_autocast ac=full mb=2x4 adamw8bit", "total_bytes": 30 << 30,
                            "step_time_s": 1.6}],
            "rejected": {"optimizer": "adamw_fused: needs 60.00 GiB + margin at the least (budget 37.25 GiB)"},
            "savings": {"checkpointing": {"saves_bytes": 20 << 30, "costs_s": 0.3},
                        "chunked_ce": {"saves_bytes": -(1 << 20), "costs_s": -0.001}},
            "infeasible": None if fits else {
                "message": "needs 50.00 GiB with every allowed technique; allowing lossy reaches 45.00 GiB",
                "smallest_total_bytes": 50 << 30, "relaxations": [{"allow": "lossy", "reaches_bytes": 45 << 30,
                                                                   "fits": False}]},
            "search": {"candidates": 6400, "evaluated": 700, "pruned_as_slower": 5100, "pruned_as_too_big": 600,
                       "seconds": 42.0, "search_s": 30.0, "profile_trace_s": 12.0},
            "notes": ["batches vary in length: planned for the longest (seq_len=4096)"]}


@pytest.mark.parametrize("fits", [True, False])
def test_render_plan_without_hydra(fits):
    buf = StringIO()
    render_plan(Plan.from_dict(_plan_dict(fits)), budget_text="40GB", console=Console(file=buf, width=140))
    out = buf.getvalue()
    for part in ("llama3_8b (LlamaForCausalLM, 8.03 B parameters)", "40GB = 37.25 GiB per GPU",
                 "pinned checkpointing=full", "full, 12 blocks per stack", "2 x 4 accumulation steps", "20.00 GiB",
                 "+300.0 ms", "uses 1.00 MiB more", "-1.0 ms (faster)", "optimizer states",
                 "Runners-up", "1.07x", "adamw_fused: needs 60.00 GiB",
                 "6400 candidates, 700 evaluated, 5100 pruned as slower, 600 pruned as too big",
                 "batches vary in length"):
        assert part in out, (part, out)
    if fits:
        assert "FITS" in out and "headroom" in out
        assert "Step time 1500.0 ms" in out and "throughput 21,845 tokens/s" in out
    else:
        assert "DOES NOT FIT" in out and "allowing lossy reaches 45.00 GiB" in out and "What allowing more" in out
        # a plan that does not fit has no step time to run at (its JSON keeps the key: golden records hash it)
        assert "Step time — (the plan does not fit the budget)" in out and "ms (forward" not in out
        assert "throughput" not in out


def test_describe_sample():
    assert describe_sample({"batch_size": 32, "image_size": 224}) == "32 images of 224 x 224 px"
    assert describe_sample({"batch_size": 8, "seq_len": 512, "decoder_seq_len": 128}).startswith(
        "8 x 512 -> 128 tokens per step")
