"""transformers' own example scripts (run_clm, run_translation, run_image_classification), each run without and
with ``trainer = memopt.wrap(trainer, budget=...)`` added after its Trainer is built, under the same budget.

Environment (datasets, evaluate, ... are not memopt's dependencies; keep them out of memopt's dev venv):

    python3 -m venv /work/venv-examples && /work/venv-examples/bin/pip install torch==2.13.0 && \\
    /work/venv-examples/bin/pip install -c constraints.txt -e ".[dev]" -r scripts/hf_examples/requirements.txt

Tiny, on the CPU (plans for an H200, trains on the CPU; the budget is then not enforced):

    /work/venv-examples/bin/python scripts/hf_examples/run_examples.py --size tiny --hardware h200 --budget 2GB \\
        --transformers-git <transformers git dir> --ref <rev> --out benchmarks/hf_examples/cpu_tiny

Real size, on a GPU (the local GPU is planned for; the plain run is capped at the same budget):

    python scripts/hf_examples/run_examples.py --size real --budget 24GB --steps 40 --out benchmarks/hf_examples/h200

Per example: ``plain`` (the script as published, the user's arguments), ``memopt`` (the patched script, the
planner's choice), ``reference`` (the plain script with the plan's precision and optimizer: memopt's plan is exact
against it, so the losses must agree), and on the CPU ``memopt_pinned`` (fp32, micro-batches and checkpointing of
one block per stack pinned: exact against ``plain``). Writes ``results.json`` and ``results.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

from check_applied import compare_losses, plan_applied  # noqa: E402
from offline_assets import SIZES, llama_overrides, make_assets  # noqa: E402
from patch_examples import EXAMPLES, copy_examples  # noqa: E402
from report_table import write_table  # noqa: E402
from torchvision_shim import allow_torchvision_without_ops  # noqa: E402

TRAINER_OPTIM = {"adamw_fused": "adamw_torch_fused", "adamw_foreach": "adamw_torch", "adamw": "adamw_torch",
                 "adamw8bit": "adamw_bnb_8bit", "paged_adamw8bit": "paged_adamw_8bit", "sgd": "sgd"}


def example_args(name: str, assets: Path, size: str, batch: int, steps: int, out: Path) -> list[str]:
    common = ["--output_dir", str(out), "--do_train", "--max_steps", str(steps),
              "--per_device_train_batch_size", str(batch), "--gradient_accumulation_steps", "1",
              "--learning_rate", "5e-4", "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
              "--seed", "0", "--disable_tqdm", "True", "--dataloader_num_workers", "0"]
    import torch

    if not torch.cuda.is_available():  # the Trainer refuses --bf16 without it (autocast runs on the CPU anyway)
        common += ["--use_cpu", "True"]
    long = size == "real"
    if name == "clm":
        return ["--model_type", "llama", "--config_overrides", llama_overrides(SIZES[size]),
                "--tokenizer_name", str(assets / "tokenizer"), "--train_file", str(assets / "train.txt"),
                "--block_size", "1024" if long else "64", *common]
    if name == "translation":
        return ["--model_name_or_path", str(assets / "t5"), "--source_lang", "en", "--target_lang", "de",
                "--source_prefix", "translate English to German: ", "--train_file", str(assets / "pairs.json"),
                "--max_source_length", "128" if long else "64", "--max_target_length", "128" if long else "64",
                *common]
    if name == "image":
        return ["--model_name_or_path", str(assets / "vit"), "--train_dir", str(assets / "images" / "train"),
                "--remove_unused_columns", "False", "--image_column_name", "image", "--label_column_name", "label",
                *common]
    raise ValueError(f"unknown example {name!r}; choose from {sorted(EXAMPLES)}")


def run_variant(script: str, args: list[str], env_extra: dict[str, str], probe: Path, cwd: Path,
                cap_bytes: int | None, log: Path) -> dict[str, Any]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_EVALUATE_OFFLINE": "1", "HF_DATASETS_CACHE": str(cwd / "datasets-cache"),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           **env_extra}
    for key in ("MEMOPT_BUDGET", "MEMOPT_HARDWARE", "MEMOPT_PINS"):
        if key not in env_extra:
            env.pop(key, None)
    command = [sys.executable, str(HERE / "launch.py"), "--probe", str(probe)]
    if cap_bytes:
        command += ["--cap-bytes", str(cap_bytes)]
    command += [script, "--", *args]
    started = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run(command, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    record = json.loads(probe.read_text()) if probe.exists() else {"ok": False, "error": "no probe output"}
    record.update(rc=rc, seconds=time.perf_counter() - started, log=str(log),
                  command=" ".join(f"{k}={shlex.quote(v)}" for k, v in env_extra.items()) + " python "
                  + " ".join(shlex.quote(c) for c in [script, *args]))
    if rc != 0 and record.get("ok"):
        record["ok"] = False
    return record


def per_example(value: str, names: list[str], what: str) -> dict[str, str]:
    """``"24GB"`` for every example, or ``"clm=24GB,image=8GB"`` (the examples not named keep ``default``)."""
    if "=" not in value:
        return dict.fromkeys(names, value)
    out: dict[str, str] = {}
    for part in value.split(","):
        name, _, v = part.partition("=")
        if name.strip() not in EXAMPLES:
            raise ValueError(f"--{what} names {name.strip()!r}; examples are {sorted(EXAMPLES)}")
        out[name.strip()] = v.strip()
    missing = [n for n in names if n not in out]
    if missing:
        raise ValueError(f"--{what} gives no value for {missing}")
    return out


def budget_bytes(budget: str) -> int:
    from memopt.units import parse_budget

    return int(parse_budget(budget))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--budget", default=os.environ.get("MEMOPT_BUDGET", "2GB"),
                        help="one budget, or one per example: clm=24GB,translation=8GB,image=8GB")
    parser.add_argument("--hardware", default=None, help="plan for this GPU (a configs/hardware name); default: "
                        "the local GPU")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", default="8", help="the user's per-device batch (no accumulation), one or per "
                        "example: clm=8,translation=32,image=64")
    parser.add_argument("--copy-only", action="store_true", help="copy and patch the scripts, make nothing else")
    parser.add_argument("--examples", default="clm,translation,image")
    parser.add_argument("--transformers-git", type=Path, default=None)
    parser.add_argument("--ref", default="HEAD")
    parser.add_argument("--transformers-src", type=Path, default=None)
    parser.add_argument("--work", type=Path, default=REPO / ".hf-examples")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--pinned", choices=["auto", "yes", "no"], default="auto",
                        help="also run memopt with fp32, micro-batches and partial checkpointing pinned (auto: on "
                             "the CPU)")
    ns = parser.parse_args()
    allow_torchvision_without_ops()
    import torch

    names = [n.strip() for n in ns.examples.split(",") if n.strip()]
    scripts = copy_examples(ns.work / "scripts", git_dir=ns.transformers_git, ref=ns.ref, src=ns.transformers_src,
                            names=names)
    if ns.copy_only:
        print(json.dumps(scripts, indent=1))
        return
    budgets = per_example(ns.budget, names, "budget")
    batches = {k: int(v) for k, v in per_example(ns.batch, names, "batch").items()}
    assets = make_assets(ns.work / "assets" / ns.size, SIZES[ns.size])
    on_gpu = torch.cuda.is_available()
    pinned = ns.pinned == "yes" or (ns.pinned == "auto" and not on_gpu)
    runs_dir = ns.work / "runs" / ns.size
    ns.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"size": ns.size, "budget": ns.budget, "hardware": ns.hardware or "local GPU",
                               "device": torch.cuda.get_device_name(0) if on_gpu else "cpu", "steps": ns.steps,
                               "batch": batches, "budgets": budgets,
                               "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
                               "examples": {}}
    import transformers

    results["transformers_installed"] = transformers.__version__
    previous = ns.out / "results.json"
    if previous.exists():  # examples run earlier into the same folder (and not run now) are kept
        kept = json.loads(previous.read_text()).get("examples", {})
        results["examples"].update({k: v for k, v in kept.items() if k not in names})
    for name in names:
        script_info = scripts[name]
        entry: dict[str, Any] = {"script": script_info, "runs": {}, "budget": budgets[name], "batch": batches[name],
                                 "command": results["command"]}
        cap = budget_bytes(budgets[name]) if on_gpu else None
        memopt_env = {"MEMOPT_BUDGET": budgets[name], **({"MEMOPT_HARDWARE": ns.hardware} if ns.hardware else {})}
        results["examples"][name] = entry

        def go(variant: str, script: str, extra_args: list[str], env: dict[str, str], capped: bool,
               name: str = name, entry: dict[str, Any] = entry, cap: int | None = cap) -> dict[str, Any]:
            out_dir = runs_dir / name / variant
            shutil.rmtree(out_dir, ignore_errors=True)
            out_dir.mkdir(parents=True)
            args = example_args(name, assets, ns.size, batches[name], ns.steps, out_dir) + extra_args
            print(f"[{name}] {variant} ...", flush=True)
            record = run_variant(script, args, env, out_dir / "probe.json", assets, cap if capped else None,
                                 out_dir / "log.txt")
            for weights in out_dir.glob("*.safetensors"):  # the trained models are not needed afterwards
                weights.unlink()
            entry["runs"][variant] = record
            print(f"[{name}] {variant}: ok={record.get('ok')} {record.get('error', '')}", flush=True)
            return record

        go("plain", script_info["original"], [], {}, capped=True)
        wrapped = go("memopt", script_info["patched"], [], memopt_env, capped=False)
        plan = wrapped.get("strategy")
        if plan:
            flags = []
            if plan["precision"] in ("bf16_autocast", "fp16_autocast"):
                flags += ["--bf16" if plan["precision"] == "bf16_autocast" else "--fp16", "True"]
            optim = TRAINER_OPTIM[plan["optimizer"]]
            plain_optim = entry["runs"]["plain"].get("trainer", {}).get("optim")
            if flags or optim != plain_optim:
                go("reference", script_info["original"], [*flags, "--optim", optim], {}, capped=False)
        if pinned:
            pins = {"precision": "fp32", "optimizer": "adamw_fused", "micro_batch_size": max(1, batches[name] // 4),
                    "checkpointing": "full", "checkpoint_blocks": 1}
            go("memopt_pinned", script_info["patched"], [], {**memopt_env, "MEMOPT_PINS": json.dumps(pins)},
               capped=False)
        runs = entry["runs"]
        for variant in ("memopt", "memopt_pinned"):
            if variant in runs:
                runs[variant]["applied"] = plan_applied(runs[variant])
        reference = runs.get("reference", runs["plain"])
        entry["exact"] = {"memopt_vs_" + ("reference" if "reference" in runs else "plain"):
                          compare_losses(runs["memopt"], reference, runs["memopt"].get("strategy"))}
        if "memopt_pinned" in runs:
            entry["exact"]["memopt_pinned_vs_plain"] = compare_losses(runs["memopt_pinned"], runs["plain"],
                                                                      runs["memopt_pinned"].get("strategy"))
        (ns.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    write_table(results, ns.out / "results.md")
    print((ns.out / "results.md").read_text())


if __name__ == "__main__":
    main()
