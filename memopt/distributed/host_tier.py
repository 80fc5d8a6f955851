"""The host tiers of an offload setting on this machine: its RAM, what its processes hold, the NVMe path.

``validate_offload`` checks before training what would otherwise fail mid-run (NVMe path missing or not writable,
too little disk, host RAM too small for the offloaded states), each error naming the fix;
``machine_host_memory_bytes`` and ``machine_host_taken_bytes`` say how much of this machine's RAM offloaded states
may have; ``nvme_swap_bytes`` reads back what ZeRO-Infinity wrote to the NVMe path. These read the machine
(``MEMOPT_HOST_MEMORY``, ``sysconf``, ``/proc/meminfo``, the file system) rather than the model, which is why the
planner and ``build_deepspeed`` share them from one place.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from memopt.distributed.memory import sharded_memory
from memopt.distributed.model_states import state_bytes
from memopt.techniques.sharding import ShardingSetting
from memopt.units import parse_bytes

__all__ = [
    "nvme_swap_bytes",
    "validate_offload",
]


def machine_host_memory_bytes() -> int:
    """This machine's RAM: ``MEMOPT_HOST_MEMORY`` (e.g. "128GiB", for VMs whose reported memory grows on use) or
    the OS's physical pages (0 when the OS does not say)."""
    if os.environ.get("MEMOPT_HOST_MEMORY"):
        return parse_bytes(os.environ["MEMOPT_HOST_MEMORY"])
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def machine_host_taken_bytes(reclaimable_bytes: int = 0) -> int:
    """RAM of this machine that its other processes and this one already hold, less ``reclaimable_bytes`` (the
    model's own host copy, freed when the engine moves it to the GPU): what offloaded states cannot have.
    0 where the OS does not say (no ``/proc/meminfo``) or ``MEMOPT_HOST_MEMORY`` overrides the machine's figure."""
    if os.environ.get("MEMOPT_HOST_MEMORY"):
        return 0
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0
    return max(0, machine_host_memory_bytes() - available - reclaimable_bytes)


def validate_offload(setting: ShardingSetting, host_ram_bytes: int | None = None, *, num_params: int | None = None,
                     precision: str = "bf16_autocast", optimizer: str = "adamw_fused",
                     nvme_free_bytes: int | None = None, headroom: float = 0.9) -> dict[str, int]:
    """Raise ``ValueError`` (naming the fix) when an offload setting cannot work on this machine.

    Checks: the NVMe path exists, is a directory and is writable (a probe file is written and removed),
    has room for the swapped states; host RAM per node (``host_ram_bytes``, e.g. ``HardwareSpec.host_memory_bytes``)
    holds the offloaded states and pinned buffers with ``1 - headroom`` left for everything else.
    Returns the host and NVMe bytes per node it checked.
    """
    need: dict[str, int] = {"host_bytes": 0, "nvme_bytes": 0}
    if num_params is not None:
        sb = state_bytes(setting.engine, precision, optimizer)
        m = sharded_memory(num_params, engine=setting.engine, stage=setting.stage, world_size=setting.world_size,
                           sb=sb, nodes=setting.nodes, replicate_size=setting.replicate_size,
                           offload_optimizer=setting.offload_optimizer, offload_params=setting.offload_params)
        need = {"host_bytes": m.host_bytes, "nvme_bytes": m.nvme_bytes, "host_pinned_bytes": m.host_pinned_bytes}
    if "nvme" in (setting.offload_optimizer, setting.offload_params):
        path = Path(setting.nvme_path or "")
        if not setting.nvme_path or not path.exists():
            raise ValueError(f"nvme_path {setting.nvme_path!r} does not exist: create the directory on a local NVMe "
                             "drive (mkdir -p) or set nvme_path to one that exists")
        if not path.is_dir():
            raise ValueError(f"nvme_path {str(path)!r} is not a directory: point it at a directory on the NVMe drive")
        try:
            with tempfile.NamedTemporaryFile(dir=path, prefix=".memopt_probe_", delete=True) as f:
                f.write(b"\0" * 4096)
                f.flush()
        except OSError as exc:
            raise ValueError(f"nvme_path {str(path)!r} is not writable ({exc.strerror}): fix its permissions "
                             "(chown/chmod) or choose a directory this user can write") from exc
        free = nvme_free_bytes if nvme_free_bytes is not None else shutil.disk_usage(path).free
        if need["nvme_bytes"] and need["nvme_bytes"] > free:
            raise ValueError(f"nvme_path {str(path)!r} has {free / 1e9:.1f} GB free but the swapped states need "
                             f"{need['nvme_bytes'] / 1e9:.1f} GB per node: free space, use a larger drive, "
                             "or add nodes")
    if host_ram_bytes is not None and need["host_bytes"]:
        usable = int(host_ram_bytes * headroom)
        if need["host_bytes"] > usable:
            fixes = ["add nodes (each holds 1/nodes of the states)"]
            if setting.engine == "deepspeed" and setting.offload_params != "nvme":
                fixes.append("offload to NVMe instead (offload_params/offload_optimizer='nvme' with an nvme_path)")
            elif setting.engine == "fsdp2":
                fixes.append("switch to engine 'deepspeed' with NVMe offload (ZeRO-Infinity)")
            if setting.offload_params != "none":
                fixes.append("keep the parameters on the GPUs (offload_params='none') if they fit")
            raise ValueError(
                f"offloading needs {need['host_bytes'] / 1e9:.1f} GB of host RAM per node "
                f"({need.get('host_pinned_bytes', 0) / 1e9:.1f} GB pinned) but only {usable / 1e9:.1f} GB of "
                f"{host_ram_bytes / 1e9:.1f} GB is usable: " + ", or ".join(fixes))
    return need


def nvme_swap_bytes(nvme_path: str | os.PathLike[str]) -> dict[str, int]:
    """Bytes of DeepSpeed's swap files under ``nvme_path`` (what ZeRO-Infinity wrote there), by kind.

    DeepSpeed 0.19 writes ``zero_stage_3/<dtype>params/rank<r>/<id>_param.tensor.swp`` (one file per parameter
    partition of at least 1 MiB, in the 16-bit dtype) and ``zero_stage_3/optimizer/rank<r>/<id>.tensor.swp`` (the
    fp32 master partition and each optimizer state of a sub-group), each padded to 1 KiB (its I/O alignment).
    Returns ``params``, ``optimizer``, ``other`` (e.g. gradient swap files) and ``total`` bytes, and ``files``.
    """
    out = {"params": 0, "optimizer": 0, "other": 0, "total": 0, "files": 0}
    root = Path(nvme_path)
    for f in root.rglob("*.swp"):
        parts = f.relative_to(root).parts
        kind = "optimizer" if "optimizer" in parts else "params" if any(p.endswith("params") for p in parts) else \
            "other"
        if kind == "optimizer" and "_gradient_" in f.name:
            kind = "other"
        size = f.stat().st_size
        out[kind] += size
        out["total"] += size
        out["files"] += 1
    return out
