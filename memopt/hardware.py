"""Hardware specs (``configs/hardware/*.yaml``) and detection of the local GPU.

A spec carries what the estimator needs: memory as the device reports it, compute capability
(which decides kernel choices such as flash attention), peak FLOP/s per dtype, HBM and host-link
bandwidth, and the memory the CUDA runtime holds outside PyTorch's allocator.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

import yaml

from memopt.errors import InputError
from memopt.host_speed import host_scale
from memopt.resources import config_names, configs_dir
from memopt.units import MiB, parse_bytes

__all__ = ["DEFAULT_HARDWARE", "HardwareSpec", "default_hardware_note", "detect_hardware", "hardware_names",
           "hardware_problems", "load_hardware"]

#: what every entry point (``memopt.plan``, ``memopt.profile``, ``memopt.wrap``) plans for when ``hardware`` is
#: not given and no GPU is visible; ``hardware="auto"`` insists on the local GPU instead
DEFAULT_HARDWARE = "h100_80gb"


@dataclass(frozen=True, kw_only=True)
class HardwareSpec:
    """One GPU model (and, for multi-GPU plans, how many of them and how they are linked)."""

    name: str
    memory_bytes: int  # torch.cuda.get_device_properties(i).total_memory
    compute_capability: tuple[int, int]
    peak_flops: dict[str, float]  # dense FLOP/s by compute dtype: "bf16", "fp16", "tf32", "fp32"
    hbm_bandwidth: float  # bytes/s
    host_link_bandwidth: float  # bytes/s, one direction, GPU <-> host (PCIe or C2C)
    # Memory held outside PyTorch's caching allocator by one training process: CUDA context,
    # module images, cuBLAS/cuDNN handles. Measured; see benchmarks/.
    runtime_overhead_bytes: int = 770 * MiB
    num_sms: int = 0
    # Multi-GPU topology (issue: sharding); defaults describe one GPU.
    gpus_per_node: int = 1
    num_nodes: int = 1
    intra_node_bandwidth: float = 0.0  # bytes/s per GPU, one direction (NVLink)
    inter_node_bandwidth: float = 0.0  # bytes/s per node, one direction (network)
    host_memory_bytes: int = 0  # host RAM per node
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # every way a spec is made (a shipped YAML, a dict, with_overrides) passes here: a negative FLOP/s made a
        # negative step time the search preferred, a zero one divided by zero deep inside the clock
        problems = hardware_problems(self)
        if problems:
            raise InputError(problems, "hardware")

    @property
    def supports_bf16(self) -> bool:
        return self.compute_capability >= (8, 0)

    @property
    def sm(self) -> int:
        """Compute capability as one number: (9, 0) -> 90."""
        return self.compute_capability[0] * 10 + self.compute_capability[1]

    def flops(self, dtype: str) -> float:
        """Peak dense FLOP/s for a compute dtype name ('bf16', 'fp16', 'fp32', 'tf32'). 'bf16' on a GPU without
        bf16 (a T4, a V100) is fp16's peak: an fp16 autocast plan is traced as the bf16 one (one trace serves both
        half precisions), so its half-precision FLOPs are recorded under 'bf16'."""
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        if dtype == "tf32":
            return self.peak_flops.get("fp32", 0.0)
        if dtype == "bf16" and "fp16" in self.peak_flops:
            return self.peak_flops["fp16"]
        raise ValueError(f"hardware {self.name!r} has no FLOP/s figure for {dtype!r}; known: {sorted(self.peak_flops)}")

    def with_overrides(self, **changes: Any) -> HardwareSpec:
        return dataclasses.replace(self, **changes)

    @property
    def cache_key(self) -> str:
        """What of the hardware changes a trace: the kernels chosen depend on the architecture only."""
        return f"sm{self.sm}"


# (field, must be > 0 rather than >= 0, what it is): the ones at 0 by default mean "not given" (num_sms, the links
# between GPUs and nodes, host RAM: the machine's)
_POSITIVE = (("memory_bytes", "bytes of GPU memory"), ("hbm_bandwidth", "bytes/s"),
             ("host_link_bandwidth", "bytes/s"), ("gpus_per_node", "GPUs"), ("num_nodes", "nodes"))
_NON_NEGATIVE = (("runtime_overhead_bytes", "bytes"), ("num_sms", "0: unknown"),
                 ("intra_node_bandwidth", "bytes/s, 0: unknown"), ("inter_node_bandwidth", "bytes/s, 0: unknown"),
                 ("host_memory_bytes", "bytes per node, 0: this machine's"))
_COUNTS = frozenset({"memory_bytes", "runtime_overhead_bytes", "num_sms", "gpus_per_node", "num_nodes",
                     "host_memory_bytes"})


def _number_problem(key: str, value: Any, positive: bool, meaning: str, integer: bool) -> str | None:
    kind = numbers.Integral if integer else numbers.Real
    ok = isinstance(value, kind) and not isinstance(value, bool) and math.isfinite(float(value))
    if ok and (value > 0 if positive else value >= 0):
        return None
    what = "an integer" if integer else "a finite number"
    return f"hardware.{key}={value!r} must be {what} {'> 0' if positive else '>= 0'} ({meaning})"


def hardware_problems(spec: HardwareSpec) -> list[str]:
    """One line per numeric field of ``spec`` that no estimate can use, naming the field and what is valid."""
    problems = []
    for fields, positive in ((_POSITIVE, True), (_NON_NEGATIVE, False)):
        for key, meaning in fields:
            line = _number_problem(key, getattr(spec, key), positive, meaning, key in _COUNTS)
            if line:
                problems.append(line)
    cc = spec.compute_capability
    if not (isinstance(cc, tuple) and len(cc) == 2 and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                           for x in cc)):
        shown = list(cc) if isinstance(cc, tuple) else cc
        problems.append(f"hardware.compute_capability={shown!r} must be a pair of integers [major, minor], e.g. "
                        "[9, 0] for an H100")
    if not isinstance(spec.peak_flops, dict) or not spec.peak_flops:
        problems.append(f"hardware.peak_flops={spec.peak_flops!r} must map compute dtypes (bf16, fp16, tf32, fp32) "
                        "to FLOP/s, e.g. {bf16: 989.0e12, fp32: 67.0e12}")
    else:
        for dtype, value in spec.peak_flops.items():
            line = _number_problem(f"peak_flops.{dtype}", value, True, "dense FLOP/s", False)
            if line:
                problems.append(line)
    return problems


def _from_dict(data: dict[str, Any]) -> HardwareSpec:
    known = {f.name for f in dataclasses.fields(HardwareSpec)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown hardware keys {unknown}; valid keys: {sorted(known)}")
    data = dict(data)
    for key in ("memory_bytes", "runtime_overhead_bytes", "host_memory_bytes"):
        if key in data and isinstance(data[key], str):
            data[key] = parse_bytes(data[key], what=key)
    # converted where they are numbers; anything else is left for the spec's own check to name with the rest
    cc = data["compute_capability"]  # a KeyError names the missing field (memopt.plan.checks.check_hardware)
    if isinstance(cc, (list, tuple)):
        data["compute_capability"] = tuple(int(x) if _whole(x) else x for x in cc)
    if isinstance(data["peak_flops"], dict):
        data["peak_flops"] = {k: _real(v) for k, v in data["peak_flops"].items()}
    for key in ("hbm_bandwidth", "host_link_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth"):
        if key in data:
            data[key] = _real(data[key])
    return HardwareSpec(**data)


def _whole(v: Any) -> bool:
    return (isinstance(v, numbers.Integral) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())


def _real(v: Any) -> Any:
    """A number (or YAML's string of one: ``1.555e12`` has no sign in its exponent) as a float; anything else as
    it is, for the spec's check to name."""
    if isinstance(v, numbers.Real) and not isinstance(v, bool):
        return float(v)
    try:
        return float(v) if isinstance(v, str) else v
    except ValueError:
        return v


def hardware_names() -> list[str]:
    return config_names("hardware")


def load_hardware(name: str | HardwareSpec | dict[str, Any] | None) -> HardwareSpec:
    """A spec by config name (``h100_80gb``), from a dict, or passed through. ``"auto"``: the local GPU (an error
    without one); None (not given): the local GPU, or ``DEFAULT_HARDWARE`` when none is visible."""
    if isinstance(name, HardwareSpec):
        return name
    if name is None or name == "auto":
        local = detect_hardware()
        if local is not None:
            return local
        if name is None:
            return load_hardware(DEFAULT_HARDWARE)
        raise ValueError("hardware='auto' needs a local GPU and none is visible; name the GPU you plan for, "
                         f"e.g. hardware={DEFAULT_HARDWARE} (shipped: {', '.join(hardware_names())})")
    if isinstance(name, dict):
        return _from_dict(name)
    path = configs_dir() / "hardware" / f"{name}.yaml"
    if not path.exists():
        raise ValueError(f"unknown hardware {name!r}; shipped specs: {', '.join(hardware_names())} "
                         "(or 'auto' to detect)")
    with path.open() as f:
        data = yaml.safe_load(f)
    data.setdefault("name", name)
    return _from_dict(data)


def default_hardware_note(hardware: Any, spec: HardwareSpec) -> str | None:
    """The note a plan carries when ``hardware`` was not given and no GPU was visible (what was used instead)."""
    if hardware is None and spec.name == DEFAULT_HARDWARE and detect_hardware() is None:
        return (f"no hardware named and no GPU visible: planned for {DEFAULT_HARDWARE} (name hardware= for another "
                "GPU)")
    return None


def detect_hardware() -> HardwareSpec | None:
    """The local GPU as a spec (the closest shipped one, with the measured memory), or None without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    cc = (props.major, props.minor)
    best: HardwareSpec | None = None
    for name in hardware_names():
        spec = load_hardware(name)
        if spec.compute_capability != cc:
            continue
        if best is None or abs(spec.memory_bytes - props.total_memory) < abs(best.memory_bytes - props.total_memory):
            best = spec
    if best is None:
        raise ValueError(
            f"no shipped hardware spec matches the local GPU {props.name!r} (sm{props.major}{props.minor}); "
            "add one under configs/hardware/ or pass hardware=<name>"
        )
    scale = host_scale()
    extra = best.extra if scale == 1.0 else {**best.extra, "host_scale": scale}
    return best.with_overrides(memory_bytes=int(props.total_memory), num_sms=props.multi_processor_count,
                               extra=extra)
