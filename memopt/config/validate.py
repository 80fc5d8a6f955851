"""Checking a composed ``python -m memopt.plan`` config and turning it into the planner's arguments.

:func:`validate` returns every problem (``[]`` when the config is good); :func:`resolve` returns a
:class:`PlanRequest` or raises one :class:`ConfigError` (a ``ValueError``) that lists them all. Each message
names the key, what was wrong, and what would be valid.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from memopt.config.omegaconf_errors import explain_omegaconf_error
from memopt.config.schema import OUTPUTS, PlanConfig
from memopt.errors import InputError
from memopt.hardware import hardware_names, load_hardware
from memopt.models import SampleSpec, load_model_spec, model_names
from memopt.plan import checks
from memopt.plan.calibrate import CALIBRATION_MODES
from memopt.plan.context import resolve_hardware
from memopt.plan.model_keys import check_model_keys
from memopt.plan.planner import make_plan
from memopt.plan.policy import Policy
from memopt.techniques.optimizers import VARIANTS
from memopt.units import format_bytes

__all__ = ["OPTIMIZER_CHOICES", "ConfigError", "PlanRequest", "closest", "resolve", "to_plain", "validate"]

#: ``training.optimizer`` values: ``auto`` (the planner chooses) or a memopt optimizer to pin
OPTIMIZER_CHOICES: tuple[str, ...] = ("auto", *VARIANTS)
_SHAPE_KEYS = ("batch_size", "seq_len", "image_size", "decoder_seq_len", "variable_length")
_SPEC_FIELDS = ("name", "family", "architecture", "hf_config", "sample")
_HW_REQUIRED = ("memory_bytes", "compute_capability", "peak_flops", "hbm_bandwidth", "host_link_bandwidth")


class ConfigError(ValueError):
    """Everything wrong with a config, one message per problem (``.problems``)."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("invalid configuration:\n  - " + "\n  - ".join(self.problems))


@dataclass
class PlanRequest:
    """What :func:`memopt.plan.make_plan` is called with, checked."""

    model: Any  # a model spec dict, or a {'_target_': ...} node
    model_label: str
    sample: Any  # a dict of shapes (spec models) or of meta tensors (a user module)
    hardware: Any  # memopt.hardware.HardwareSpec
    budget: Any  # as the user wrote it
    budget_bytes: int
    policy: Any  # memopt.plan.Policy
    loss_fn: Callable[..., Any] | None = None
    optimizer: str = "auto"
    optimizer_kwargs: dict[str, Any] = field(default_factory=dict)
    output: str = "table"
    save_plan: str | None = None
    use_cache: bool = True
    calibration: str = "use"

    def plan(self) -> Any:
        """Run the planner (``memopt.plan.make_plan``) on this request."""
        return make_plan(self.model, self.sample, budget=self.budget_bytes, hardware=self.hardware,
                         policy=self.policy, loss_fn=self.loss_fn, use_cache=self.use_cache,
                         calibration=self.calibration)


def closest(name: Any, choices: list[str] | tuple[str, ...]) -> str:
    """`` (did you mean 'x'?)`` for the closest choice, or '' (``memopt.plan.checks.closest``)."""
    return checks.closest(name, choices)


def to_plain(cfg: Any) -> dict[str, Any]:
    """A composed config (DictConfig, dataclass or dict) as a plain dict of the schema's keys, without ``hydra``.

    The config is merged into the schema, so missing keys take their defaults and unknown ones are reported:
    a key added on the command line with ``+`` (which Hydra lets past the schema) is checked as the same key
    without ``+`` would be.
    """
    problems: list[str] = []
    data = _plain(cfg, problems)
    if problems:
        raise ConfigError(problems)
    return data


def _plain(cfg: Any, problems: list[str]) -> dict[str, Any]:
    """:func:`to_plain` that appends each unknown or mistyped key to ``problems`` and drops it, so the rest of the
    config is still checked (every problem at once)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        cfg = OmegaConf.structured(cfg)
    if not isinstance(cfg, Mapping):
        raise ConfigError([f"a plan config must be a mapping, got {type(cfg).__name__}"])
    source = _tree(cfg)
    source.pop("hydra", None)
    typed = _into_schema(source, problems)
    if typed is None:
        raise ConfigError(problems)
    try:
        data = OmegaConf.to_container(typed, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as exc:
        raise ConfigError([*problems, *explain_omegaconf_error(exc)]) from None
    assert isinstance(data, dict)
    return data


def _tree(node: Any) -> Any:
    """A copy of ``node`` whose mappings are dicts (a DictConfig's interpolations left unresolved: they resolve
    once, against the typed config), so refused keys can be dropped without touching the caller's config."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=False)
    if isinstance(node, Mapping):
        return {key: _tree(value) for key, value in node.items()}
    return node


def _into_schema(source: dict[str, Any], problems: list[str]) -> Any:
    """``source`` merged into :class:`PlanConfig`; each key the schema refuses is reported and left out, or None
    when a refused key cannot be told apart from its node (a whole section of the wrong type)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    while True:
        try:
            return OmegaConf.merge(OmegaConf.structured(PlanConfig), source)
        except OmegaConfBaseException as exc:
            problems.extend(p for p in explain_omegaconf_error(exc) if p not in problems)
            if not _drop(source, str(getattr(exc, "full_key", "") or "")):
                return None


def _drop(tree: dict[str, Any], full_key: str) -> bool:
    """Remove ``full_key`` (``training.lr``; a list item's key drops the whole list) from ``tree``; False when
    there is no such key to remove."""
    parts = full_key.split("[", 1)[0].split(".") if full_key else []
    node: Any = tree
    for part in parts[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    if not parts or not isinstance(node, dict) or parts[-1] not in node:
        return False
    del node[parts[-1]]
    return True


def validate(cfg: Any) -> list[str]:
    """Every problem with a plan config (``[]`` when it can be planned)."""
    try:
        resolve(cfg)
    except ConfigError as exc:
        return exc.problems
    return []


def resolve(cfg: Any) -> PlanRequest:
    """The planner's arguments from a composed config; raises :class:`ConfigError` listing every problem. The
    checks are those of the Python API (:mod:`memopt.plan.checks`), with the config's key names."""
    problems: list[str] = []
    data = _plain(cfg, problems)
    model = data.get("model") or {}
    training = data.get("training") or {}

    hardware = _hardware(data.get("hardware") or {}, problems)
    policy = _policy(data.get("policy") or {}, training, problems)
    spec, model_arg, label, loss_fn = _model(model, problems)
    sample = _sample(spec, model, training, problems)

    budget_text = data.get("budget")
    budget_bytes = checks.check_budget(budget_text, problems,
                                       device_total_bytes=hardware.memory_bytes if hardware else None) or 0
    checks.check_margin(policy, budget_bytes, problems)
    if spec is not None:
        check_model_keys(spec, problems)
    if budget_bytes and hardware is not None and budget_bytes <= hardware.runtime_overhead_bytes:
        margin = policy.margin(budget_bytes) if policy is not None else 0
        least = hardware.runtime_overhead_bytes + margin + (1 << 30)
        problems.append(
            f"budget {budget_text} ({format_bytes(budget_bytes)}) is below what the CUDA runtime alone holds on "
            f"{hardware.name} ({format_bytes(hardware.runtime_overhead_bytes)} outside PyTorch's allocator); "
            f"give at least {format_bytes(least)} (budget={-(-least // 10**9)}GB) for the smallest models")

    if policy is not None and sample is not None and "micro_batch_size" in policy.pins:
        batch = sample.get("batch_size", spec.sample.get("batch_size") if spec is not None else None) \
            if isinstance(sample, dict) and not model.get("_target_") else (training.get("batch_size"))
        checks.check_global_batch_pins(policy.pins, batch, problems, key="policy.pins.micro_batch_size",
                                       batch_key="training.batch_size")
    # a null hyper-parameter is the optimizer's default: it is not passed on, so there is nothing to check
    kwargs = {k: v for k, v in (training.get("optimizer_kwargs") or {}).items() if v is not None}
    checks.check_hyperparameters(kwargs, problems, prefix="training.optimizer_kwargs.",
                                 optimizer=training.get("optimizer"))
    calibration = data.get("calibration", "use")
    if calibration not in CALIBRATION_MODES:
        problems.append(f"calibration={calibration!r} is not one of {', '.join(CALIBRATION_MODES)}"
                        f"{closest(calibration, CALIBRATION_MODES)}")

    output = data.get("output")
    if output not in OUTPUTS:
        problems.append(f"output={output!r} is not one of {', '.join(OUTPUTS)}{closest(output, OUTPUTS)}")
    save_plan = data.get("save_plan")
    if save_plan is not None and not isinstance(save_plan, str):
        problems.append(f"save_plan must be a file path, got {save_plan!r}")
    use_cache = data.get("use_cache", True)
    if not isinstance(use_cache, bool):
        problems.append(f"use_cache must be true or false, got {use_cache!r}")
    if problems:
        raise ConfigError(problems)
    return PlanRequest(model=model_arg, model_label=label, sample=sample, hardware=hardware, budget=budget_text,
                       budget_bytes=budget_bytes, policy=policy, loss_fn=loss_fn,
                       optimizer=training.get("optimizer") or "auto", optimizer_kwargs=kwargs, output=output,
                       save_plan=save_plan, use_cache=use_cache, calibration=calibration)


# -- the parts ------------------------------------------------------------------------------------------------


def _hardware(node: dict[str, Any], problems: list[str]) -> Any:
    node = dict(node)
    extra = {k: v for k, v in (node.get("extra") or {}).items() if v is not None}
    node["extra"] = extra
    checks.check_nvme_path(extra.get("nvme_path"), problems, key="hardware.extra.nvme_path")
    checks.check_world(node.get("gpus_per_node"), node.get("num_nodes"), problems, prefix="hardware.",
                       names=("gpus_per_node", "num_nodes"))
    if any(p.startswith(("hardware.gpus_per_node", "hardware.num_nodes")) for p in problems):
        return None
    given = {k: v for k, v in node.items() if v is not None and v != {}}
    name = given.get("name", "auto")
    try:
        if set(given) <= {"name"}:
            if name != "auto" and name not in hardware_names():
                names = hardware_names()
                problems.append(f"unknown hardware {name!r}{closest(name, names)}; shipped: {', '.join(names)} "
                                "(hardware=<name>), or hardware=auto for the local GPU")
                return None
            return checks.check_hardware_timing(resolve_hardware(name), problems)
        missing = [k for k in _HW_REQUIRED if k not in given]
        if missing:
            problems.append(f"hardware {name!r} is missing {', '.join(missing)}: start from a shipped spec "
                            f"(hardware=h100_80gb hardware.memory_bytes=...) or give every field")
            return None
        return checks.check_hardware_timing(load_hardware(given), problems)
    except InputError as exc:  # one line per field, each naming it already
        problems.extend(exc.problems)
        return None
    except (ValueError, TypeError) as exc:
        problems.append(f"hardware: {exc}")
        return None


def _policy(node: dict[str, Any], training: dict[str, Any], problems: list[str]) -> Any:
    pins = {k: v for k, v in (node.get("pins") or {}).items() if v is not None}
    forbid = {k: v for k, v in (node.get("forbid") or {}).items() if v is not None and v != []}
    optimizer = training.get("optimizer") or "auto"
    if optimizer not in OPTIMIZER_CHOICES:
        problems.append(f"training.optimizer={optimizer!r} is not one of {', '.join(OPTIMIZER_CHOICES)}"
                        f"{closest(optimizer, OPTIMIZER_CHOICES)}")
    elif optimizer != "auto":
        if "optimizer" in pins and pins["optimizer"] != optimizer:
            problems.append(f"training.optimizer={optimizer} contradicts policy.pins.optimizer={pins['optimizer']}; "
                            "set one of them")
        else:
            pins["optimizer"] = optimizer
    fidelity = node.get("fidelity")
    if fidelity is None:
        fidelity = "default"
    try:
        policy = Policy.build(fidelity=fidelity, pins=pins, forbid=forbid, margin=node.get("margin"),
                              max_micro_batch=node.get("max_micro_batch"))
    except ValueError as exc:
        lines = [line.strip()[2:] for line in str(exc).splitlines() if line.strip().startswith("- ")]
        problems.extend(f"policy: {line}" for line in (lines or [str(exc)]))
        return None
    return policy


def _model(node: dict[str, Any], problems: list[str]) -> tuple[Any, Any, str, Callable[..., Any] | None]:
    """(model spec or None, the planner's model argument, a label, loss_fn)."""
    loss_fn = None
    if node.get("loss_fn"):
        loss_fn = _locate(node["loss_fn"], "model.loss_fn", problems)
    target = node.get("_target_")
    spec_given = {k: node[k] for k in _SPEC_FIELDS if node.get(k) not in (None, {}, "")}
    if target:
        extra = sorted(set(spec_given) - {"name"})
        if extra:
            problems.append(f"model has both _target_ and spec keys {extra}: give a model spec (name, family, "
                            "architecture, hf_config, sample) or a _target_ with kwargs and inputs, not both (on the "
                            "command line, '~model' first drops the default model: python -m memopt.plan '~model' "
                            "'+model._target_=pkg.Net' '+model.inputs={x: {shape: [784]}}' training.batch_size=32)")
        found = _locate(target, "model._target_", problems)
        if not node.get("inputs"):
            problems.append("model.inputs is required with model._target_: one example's tensors, e.g. "
                            "{x: {shape: [784]}, labels: {shape: [], dtype: int64}}")
        if found is None:
            return None, None, str(target), loss_fn
        return None, {"_target_": target, **(node.get("kwargs") or {})}, node.get("name") or str(target), loss_fn
    for key in ("kwargs", "inputs"):
        if node.get(key):
            problems.append(f"model.{key} applies to a model built by _target_ only (model {node.get('name')!r} "
                            "is a spec: change it through model.hf_config)")
    if not spec_given:
        problems.append(f"no model: choose one with model=<name> ({', '.join(model_names())}), or give a spec "
                        "(name, family, architecture, hf_config) or a _target_")
        return None, None, "", loss_fn
    spec_dict = {k: v for k, v in spec_given.items()}
    try:
        spec = load_model_spec(spec_dict)
    except ValueError as exc:
        problems.append(f"model: {exc}")
        return None, None, str(node.get("name")), loss_fn
    return spec, spec_dict, spec.name, loss_fn


def _sample(spec: Any, model: dict[str, Any], training: dict[str, Any], problems: list[str]) -> Any:
    shapes = {k: training.get(k) for k in _SHAPE_KEYS if training.get(k) is not None}
    if spec is not None:
        try:
            SampleSpec.parse(shapes, spec)
        except ValueError as exc:
            text = str(exc)
            problems.append(f"training: {text}" if not text.startswith("invalid sample") else
                            "training: " + text.replace("invalid sample", "invalid training shapes", 1))
        return shapes
    if not model.get("_target_"):
        return shapes
    return _user_batch(model.get("inputs") or {}, shapes, problems)


def _user_batch(inputs: dict[str, Any], shapes: dict[str, Any], problems: list[str]) -> dict[str, Any] | None:
    """Meta tensors shaped like one global batch of a user module: ``inputs`` gives one example."""
    import torch

    batch = shapes.get("batch_size")
    if batch is None:
        problems.append("training.batch_size is required for a model built by _target_ (it has no typical sample)")
        return None
    unused = sorted(set(shapes) - {"batch_size"})
    if unused:
        problems.append(f"training.{', training.'.join(unused)} do not apply to a _target_ model: its "
                        "model.inputs give the example's shapes")
    out: dict[str, Any] = {}
    for name, entry in inputs.items():
        if isinstance(entry, (list, tuple)):
            entry = {"shape": list(entry)}
        if not isinstance(entry, dict) or "shape" not in entry:
            problems.append(f"model.inputs.{name} must be a shape list or {{shape: [...], dtype: float32}}")
            continue
        unknown = sorted(set(entry) - {"shape", "dtype"})
        if unknown:
            problems.append(f"model.inputs.{name}: unknown keys {unknown} (valid: shape, dtype)")
        shape = entry["shape"]
        if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and d > 0 for d in shape):
            problems.append(f"model.inputs.{name}.shape must be a list of positive ints, got {shape!r}")
            continue
        dtype_name = str(entry.get("dtype") or "float32")
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            problems.append(f"model.inputs.{name}.dtype {dtype_name!r} is not a torch dtype (float32, bfloat16, "
                            "int64, bool ...)")
            continue
        out[name] = torch.empty((batch, *shape), dtype=dtype, device="meta")
    return out


def _locate(path: str, key: str, problems: list[str]) -> Any:
    """The object at a dotted path (``package.module.Name``), importing the longest module prefix."""
    import importlib

    parts = str(path).split(".")
    error: BaseException | None = None
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError as exc:
            error = error or exc
            continue
        except Exception as exc:  # the module exists but fails to import
            error = exc
            break
        try:
            for name in parts[i:]:
                obj = getattr(obj, name)
        except AttributeError as exc:
            error = exc
            break
        return obj
    detail = f" ({type(error).__name__}: {str(error).splitlines()[0]})" if error is not None else ""
    problems.append(f"{key}={path!r} cannot be imported{detail}; give a dotted path such as my_package.models.MyNet")
    return None

