"""The dry run: ``python -m memopt.plan [overrides]`` (also installed as ``memopt-plan``).

Plans the fastest strategy that fits a memory budget, on the CPU, and prints why::

    python -m memopt.plan                                      # the bundled default (configs/plan.yaml)
    python -m memopt.plan model=llama3_8b budget=40GB training.batch_size=8 training.seq_len=4096 \\
        hardware=h100_80gb policy=8bit
    python -m memopt.plan output=json save_plan=plan.json      # machine form: the plan as JSON, nothing else
    python -m memopt.plan -m budget=16GB,24GB,40GB,80GB        # one plan per budget (Hydra multirun)
    python -m memopt.plan --config-dir recipes --config-name llama3_8b_full_ft_h100

Exit status: 0 a plan fits; 3 nothing fits the budget (the report says what would); 2 bad input (every
problem is listed, with what would be valid). Nothing else: an unexpected error inside memopt is reported
as one line (its type and message, and where to report it) with status 2 too, never as a traceback
(``MEMOPT_DEBUG=1`` shows the traceback). A multirun exits with the worst of its
jobs (2 over 3 over 0). In a multirun each job saves its plan as ``multirun/<date>/<time>/<job>/plan.json``
(a relative ``save_plan`` is placed in the job's folder too), and ``output=json`` prints one JSON object
per line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.errors import InstantiationException
from omegaconf import DictConfig

from memopt.cli_render import make_console, render_errors, render_plan
from memopt.config.errors import diagnose, explain_hydra_error
from memopt.config.omegaconf_errors import one_line, root_cause, with_root_cause
from memopt.config.store import register
from memopt.config.validate import ConfigError, resolve
from memopt.resources import configs_dir

__all__ = ["EXIT_BAD_INPUT", "EXIT_INFEASIBLE", "EXIT_OK", "main", "run"]

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_INFEASIBLE = 3

register()
_CODES: list[int] = []  # the exit code of each job of this invocation (multirun jobs run in this process)


def _job_context() -> tuple[bool, Path | None, str]:
    """(multirun?, the job's output folder, a label naming the job's overrides)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return False, None, ""
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return False, None, ""
    overrides = " ".join(hc.overrides.task)
    return True, Path(hc.runtime.output_dir), f"job {hc.job.num}: {overrides}".strip()


def _save_path(save_plan: str | None, multirun: bool, job_dir: Path | None) -> Path | None:
    if not multirun or job_dir is None:
        return Path(save_plan) if save_plan else None
    if save_plan is None:
        return job_dir / "plan.json"
    path = Path(save_plan)
    return path if path.is_absolute() else job_dir / path


def run(cfg: Any) -> int:
    """Plan one composed config and print the report; returns the exit status. Bad input -> 2, no fit -> 3.
    Nothing escapes to Hydra, whose job runner would print its own "Error executing job" line before ours."""
    multirun, job_dir, label = _job_context()
    err = make_console(stderr=True)
    title = f"invalid input ({label})" if label else "invalid input"
    model = None
    try:
        try:
            request = resolve(cfg)
        except ConfigError as exc:
            render_errors([in_cli_terms(p) for p in exc.problems], console=err, title=title)
            return EXIT_BAD_INPUT
        model = request.model
        try:
            plan = request.plan()
        except ValueError as exc:
            problems = getattr(exc, "problems", None) or [str(exc)]
            render_errors([in_cli_terms(p) for p in problems], console=err, title=title)
            return EXIT_BAD_INPUT
        return _report(request, plan, multirun, job_dir, label, err, title)
    except Exception as exc:  # never a traceback: one line, and how to report it
        if os.environ.get("MEMOPT_DEBUG"):
            raise
        render_errors([model_build_error(exc, model) or unexpected(exc)], console=err, title=title)
        return EXIT_BAD_INPUT


def _report(request: Any, plan: Any, multirun: bool, job_dir: Path | None, label: str, err: Any, title: str) -> int:
    """Save and print a plan as the request asks; returns the exit status."""
    out = make_console()
    path = _save_path(request.save_plan, multirun, job_dir)
    if path is not None:
        try:
            plan.save(path)
        except OSError as exc:  # the folder cannot be made or written, or the path is a folder
            reason = f"{exc.strerror}: {exc.filename!r}" if exc.strerror else str(exc)
            render_errors([f"save_plan={request.save_plan!r}: cannot write the plan to {str(path)!r} ({reason}); "
                           "give a file path in a folder you can write to"], console=err, title=title)
            return EXIT_BAD_INPUT
    if request.output == "json":
        sys.stdout.write(json.dumps(plan.to_dict(), indent=None if multirun else 2, default=str) + "\n")
        sys.stdout.flush()
        if not plan.fits:
            message = (plan.infeasible or {}).get("message", "no strategy fits the budget")
            err.print(f"memopt.plan: does not fit: {message}", soft_wrap=True, highlight=False)
    else:
        if multirun:
            out.rule(label)
        render_plan(plan, hardware=request.hardware, budget_text=request.budget, console=out)
        if path is not None:
            out.print(f"plan saved to {path}", soft_wrap=True)
    return EXIT_OK if plan.fits else EXIT_INFEASIBLE


def in_cli_terms(message: str) -> str:
    """A planner message as the command line reads it: the keys that stand for the Python arguments it names."""
    message = message.replace("margin=", "policy.margin=")
    if "loss_fn=" in message and "+model.loss_fn" not in message:
        message += ("; on the command line, name it as +model.loss_fn=<module>.<function> (a function "
                    "(output, batch) -> loss that Python can import)")
    return message


@hydra.main(config_path=str(configs_dir()), config_name="plan", version_base=None)
def _hydra_job(cfg: DictConfig) -> int:
    code = run(cfg)
    _CODES.append(code)
    return code


def _argv_parts(argv: list[str]) -> tuple[list[str], str, str | None]:
    """(overrides, config name, extra config dir) as Hydra reads them from the command line."""
    from hydra._internal.utils import get_args_parser

    try:
        args, _ = get_args_parser().parse_known_args(argv)
    except SystemExit:
        return [], "plan", None
    return list(args.overrides or []), args.config_name or "plan", args.config_dir


def unexpected(exc: BaseException) -> str:
    """One line for an error memopt did not expect (a bug, or input no check caught), with its root cause: the
    wrappers' own messages (Hydra's, huggingface_hub's) end where the reason would start."""
    return (f"unexpected error {with_root_cause(exc)} -- the input may be invalid in a way memopt does not "
            "check yet; please report it with the command line (MEMOPT_DEBUG=1 shows the traceback)")


def model_build_error(exc: BaseException, model: Any) -> str | None:
    """One line for a model the config describes but that cannot be built (None: ``exc`` is not that): a
    ``_target_`` whose call fails (Hydra wraps the error in an ``InstantiationException``), or an ``hf_config``
    that transformers refuses (a strict-dataclass validation error)."""
    root = root_cause(exc)
    reason = f"{type(root).__name__}: {one_line(root)}"
    if isinstance(exc, InstantiationException) and isinstance(model, dict) and model.get("_target_"):
        return (f"model._target_={model['_target_']!r} cannot build the model ({reason}); model.kwargs are passed "
                "to it as keyword arguments, on the meta device")
    strict = any(cls.__name__ == "StrictDataclassError" for cls in type(exc).__mro__)
    if strict and isinstance(model, dict) and not model.get("_target_"):
        architecture = model.get("architecture") or model.get("name") or "the model"
        return f"model.hf_config is not a valid config for {architecture}: {reason}"
    return None


def main(argv: list[str] | None = None) -> int:
    """Run the dry run as Hydra does from ``sys.argv`` (or ``argv``); returns the exit status."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    try:
        import transformers

        transformers.logging.set_verbosity_error()  # config warnings are noise in a report
    except Exception:
        pass
    _CODES.clear()
    previous = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"  # let composition errors reach us instead of Hydra's printer
    try:
        _hydra_job()
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        overrides, config_name, config_dir = _argv_parts(sys.argv[1:])
        try:
            problems = diagnose(overrides, config_name=config_name, config_dir=config_dir)
        except Exception:
            problems = []
        render_errors(problems or explain_hydra_error(exc, primary_dirs=[configs_dir()]))
        return EXIT_BAD_INPUT
    except SystemExit as exc:  # Hydra's own exits (--help: 0; its error printer: 1, which is bad input here)
        if exc.code in (0, None):
            return EXIT_OK
        return EXIT_BAD_INPUT if exc.code not in (EXIT_BAD_INPUT, EXIT_INFEASIBLE) else int(exc.code)
    except Exception as exc:
        if os.environ.get("MEMOPT_DEBUG"):
            raise
        render_errors([unexpected(exc)])
        return EXIT_BAD_INPUT
    finally:
        if previous is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = previous
    if EXIT_BAD_INPUT in _CODES:
        return EXIT_BAD_INPUT
    if EXIT_INFEASIBLE in _CODES:
        return EXIT_INFEASIBLE
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
