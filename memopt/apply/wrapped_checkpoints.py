"""``Wrapped``'s checkpoints: ``state_dict`` / ``load_state_dict`` of the training state (model, optimizer, scaler,
schedule, step and data position: ``memopt.apply.checkpoint_state``), and ``save`` / ``load`` of it as a file, or
through an offload plan's engine, which writes folders."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from memopt.apply.checkpoint_path import CHECKPOINT_FILE, checkpoint_file
from memopt.apply.checkpoint_state import read_checkpoint, restore_training_state, training_state, write_checkpoint

__all__ = ["WrappedCheckpoints"]


class WrappedCheckpoints:
    """The checkpoint methods of ``memopt.apply.wrapped.Wrapped``, which holds the state they read and write."""

    _user_model: Any
    _prepared: Any
    _sharded: Any
    plan: Any
    steps_done: int
    items_seen: int

    def _require_prepared(self) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        self._require_prepared()
        return training_state(self._user_model, self._prepared, steps_done=self.steps_done,
                              items_seen=self.items_seen, plan=self.plan.to_dict() if self.plan is not None else None)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._require_prepared()
        restore_training_state(self._user_model, self._prepared, state)
        self.steps_done = state.get("steps_done", 0)
        self.items_seen = state.get("items_seen", 0)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """A checkpoint of the model, optimizer, step and data position; returns where it is. ``path`` is a file,
        or a folder (one that exists, or written with a trailing slash) to hold ``CHECKPOINT_FILE``: the offload
        engines write folders, so a script that saves to a folder works under either kind of plan."""
        if self._sharded is not None:
            return self._sharded.save(path)
        out = checkpoint_file(path)
        write_checkpoint(out, self.state_dict())
        return out

    def load(self, path: str | os.PathLike[str]) -> None:
        """Resume from ``save``'s checkpoint."""
        if self._sharded is not None:
            self._sharded.load(path)
            return
        file = checkpoint_file(path)
        if not file.is_file():
            raise FileNotFoundError(f"no memopt checkpoint at {file}: pass the path wrapped.save returned (a file, or "
                                    f"the folder holding {CHECKPOINT_FILE})")
        self.load_state_dict(read_checkpoint(file))
