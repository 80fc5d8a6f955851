"""Where a one-GPU checkpoint goes: ``Wrapped.save`` takes a file or a folder, as the offload engines' folders do."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CHECKPOINT_FILE", "checkpoint_file"]

CHECKPOINT_FILE = "memopt_checkpoint.pt"  # the file a folder given to ``save`` holds


def checkpoint_file(path: str | os.PathLike[str]) -> Path:
    """``path`` itself, or ``CHECKPOINT_FILE`` inside it when it is a folder: one that exists, or a path written
    with a trailing separator."""
    out = Path(path)
    if out.is_dir() or str(path).endswith((os.sep, "/")):
        return out / CHECKPOINT_FILE
    return out
