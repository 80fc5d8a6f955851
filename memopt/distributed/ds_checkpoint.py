"""DeepSpeed checkpoints of a sharded run, resumable on another world size or ZeRO stage.

``save_deepspeed`` writes DeepSpeed's own checkpoint (``engine.save_checkpoint``: every rank its partition of the
parameters and optimizer states) under a tag named for the step, plus ``memopt_checkpoint.json``: the layout it was
written in (stage, world size), the step and the data position (``samples_seen``).

``load_deepspeed`` reads it back into the current engine. In the same layout it is DeepSpeed's plain load. In
another layout (a different world size, or ZeRO-1/2 <-> ZeRO-3) the partitions no longer line up, so the
checkpoint is converted once to DeepSpeed's universal format (``deepspeed.checkpoint.ds_to_universal``: one folder
per parameter with its fp32 value and Adam states) and loaded with ``load_universal``, which re-partitions each
parameter for the new layout. The conversion is kept next to the original (``<tag>_universal``); nothing the
user had is rewritten.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["CHECKPOINT_META", "load_deepspeed", "save_deepspeed", "to_universal"]

#: what memopt writes next to DeepSpeed's checkpoint: the layout, the step and the data position
CHECKPOINT_META = "memopt_checkpoint.json"


def _rank_and_barrier() -> tuple[int, Any]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.barrier
    return 0, lambda: None


def save_deepspeed(engine: Any, path: str | os.PathLike[str], *, stage: int, world_size: int, steps_done: int,
                   samples_seen: int) -> Path:
    """Write ``engine``'s checkpoint under ``path`` (all ranks call this); returns the tag's folder."""
    path = Path(path)
    tag = f"step{steps_done}"
    counters = {"steps_done": int(steps_done), "samples_seen": int(samples_seen)}
    from deepspeed.checkpoint.constants import (
        UNIVERSAL_CHECKPOINT_INFO,
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
        UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    )

    # the universal conversion needs this client state (Megatron-DeepSpeed writes it; a plain model has no
    # tensor-parallel patterns to declare, only the format's version)
    info = {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}
    engine.save_checkpoint(str(path), tag=tag, client_state={"memopt": counters, UNIVERSAL_CHECKPOINT_INFO: info})
    rank, barrier = _rank_and_barrier()
    if rank == 0:
        meta = {"engine": "deepspeed", "stage": int(stage), "world_size": int(world_size), "tag": tag, **counters}
        (path / CHECKPOINT_META).write_text(json.dumps(meta, indent=1) + "\n")
    barrier()
    return path / tag


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The layout and counters ``save_deepspeed`` wrote; a clear error when ``path`` holds no such checkpoint."""
    meta_file = Path(path) / CHECKPOINT_META
    if not meta_file.is_file():
        raise ValueError(f"{path} holds no memopt DeepSpeed checkpoint ({CHECKPOINT_META} is missing): pass the "
                         "folder that save_checkpoint wrote, or load DeepSpeed's own checkpoints with "
                         "engine.load_checkpoint")
    return json.loads(meta_file.read_text())


def to_universal(path: str | os.PathLike[str], tag: str, shapes: dict[str, tuple[int, ...]] | None = None) -> str:
    """Convert the checkpoint ``path/tag`` to DeepSpeed's universal format once (rank 0; the others wait);
    returns the universal tag. ``shapes``: each parameter's full shape by name, to give a ZeRO-3 checkpoint's flat
    states the shaped form ZeRO-1/2 read. The original is left as it is."""
    path = Path(path)
    utag = f"{tag}_universal"
    rank, barrier = _rank_and_barrier()
    if rank == 0 and not (path / utag).is_dir():
        cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(path / tag),
               "--output_folder", str(path / utag), "--num_extract_workers", "1", "--num_merge_workers", "1",
               "--inject_missing_state"]  # for a checkpoint DeepSpeed wrote without the client state above
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"DeepSpeed's universal-checkpoint conversion of {path / tag} failed "
                               f"(the original checkpoint is untouched):\n{proc.stderr[-3000:]}")
        _alias_model_states(path / utag)
        _both_stages_optimizer_state(path / utag / "zero")
        if shapes:  # the parameters' full shapes are the same whatever stage resumes: shaped once, here
            _shaped_states(path / utag / "zero", shapes)
    barrier()
    return utag


def _alias_model_states(folder: Path) -> None:
    """Give the universal folder's model-states file both of DeepSpeed's names. The weights and optimizer states
    come from its ``zero/`` folder; the model-states file carries the rest, and DeepSpeed looks for it as
    ``mp_rank_XX_model_states.pt`` at ZeRO-1/2 but as ``zero_pp_rank_0_mp_rank_XX_model_states.pt`` at ZeRO-3, so
    a checkpoint saved at one stage is found at the other."""
    import shutil

    for f in sorted(folder.glob("*model_states.pt")):
        name = f.name
        if name.startswith("zero_pp_rank_"):
            if not name.startswith("zero_pp_rank_0_"):
                continue
            other = name[len("zero_pp_rank_0_"):]
        else:
            other = f"zero_pp_rank_0_{name}"
        if not (folder / other).exists():
            shutil.copyfile(f, folder / other)


def _both_stages_optimizer_state(zero: Path) -> None:
    """Make the universal folder's global optimizer state readable at every ZeRO stage. DeepSpeed 0.19.8 writes it
    in the saving stage's shape: ZeRO-1/2 loaders read ``param_groups`` at the top and each parameter's
    ``step.pt``; the ZeRO-3 loader reads ``optimizer_state_dict`` -> ``state[0]['step']`` and its
    ``param_groups``. Each missing piece is filled from the other."""
    import torch

    state_file = zero / "optimizer_state.pt"
    sd = torch.load(state_file, weights_only=False)
    nested = sd.get("optimizer_state_dict")
    step_files = sorted(zero.glob("*/step.pt"))
    if isinstance(nested, dict) and nested.get("state"):
        step = next(iter(nested["state"].values())).get("step")
    elif step_files:
        step = torch.load(step_files[0], weights_only=False)
    else:
        step = None
    groups = sd.get("param_groups") or (nested or {}).get("param_groups")
    if groups is None:
        raise RuntimeError(f"{state_file} has no optimizer param_groups: DeepSpeed's universal format changed")
    sd["param_groups"] = groups
    if not (isinstance(nested, dict) and nested.get("state")):
        sd["optimizer_state_dict"] = {"state": {0: {"step": step}}, "param_groups": groups}
    if "ds_version" not in sd:
        import deepspeed

        sd["ds_version"] = deepspeed.__version__
    torch.save(sd, state_file)
    if step is not None:  # ZeRO-1/2 take each parameter's step from its own folder
        for folder in (p for p in zero.iterdir() if p.is_dir()):
            if not (folder / "step.pt").exists():
                torch.save(step, folder / "step.pt")


def _shaped_states(zero: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """ZeRO-3's universal conversion stores each parameter's fp32 value and Adam states as flat tensors; ZeRO-1/2
    read ``{"param": <full-shaped tensor>, "cat_dim": 0}`` (ZeRO-3 reads both). Flat files become the shaped form."""
    import torch

    for name, shape in shapes.items():
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            f = zero / name / f"{key}.pt"
            if not f.is_file():
                continue
            value = torch.load(f, weights_only=False)
            if isinstance(value, torch.Tensor):
                if value.numel() != math.prod(shape):
                    raise RuntimeError(f"{f}: {value.numel()} elements, but the model's {name} has shape {shape}")
                torch.save({"param": value.reshape(shape), "cat_dim": 0}, f)


def load_deepspeed(engine: Any, path: str | os.PathLike[str], *, stage: int, world_size: int) -> dict[str, int]:
    """Load the checkpoint ``save_deepspeed`` wrote into ``engine`` (all ranks call this), converting it to the
    universal format when it was written at another world size or ZeRO stage. Returns the step and data position
    it was saved at (``steps_done``, ``samples_seen``)."""
    meta = read_meta(path)
    if meta.get("engine") != "deepspeed":
        raise ValueError(f"{path} was written by {meta.get('engine')!r}, not DeepSpeed")
    same_layout = meta["stage"] == stage and meta["world_size"] == world_size
    if same_layout:
        load_path, _ = engine.load_checkpoint(str(path), tag=meta["tag"])
    else:
        shapes = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in engine.module.named_parameters()}
        utag = to_universal(path, meta["tag"], shapes)
        config = engine._config  # DeepSpeed reads this flag when it loads (engine.load_universal_checkpoint())
        config.load_universal_checkpoint = True
        try:
            load_path, _ = engine.load_checkpoint(str(path), tag=utag)
        finally:
            config.load_universal_checkpoint = False
    if load_path is None:
        raise ValueError(f"DeepSpeed found no checkpoint to load in {path} (tag {meta['tag']})")
    return {"steps_done": int(meta["steps_done"]), "samples_seen": int(meta["samples_seen"])}
