"""Checkpoints of a wrapped Trainer describe the script's batch, not memopt's.

memopt runs the Trainer on its own batch arguments (the process's global batch in one accumulation step, split
inside ``training_step``). transformers writes the arguments into every checkpoint (``training_args.bin``) and the
loader's batch size into ``trainer_state.json`` (``train_batch_size``), and under ``auto_find_batch_size`` a resumed
run takes that batch size for its loader while keeping its own accumulation steps. A checkpoint holding memopt's
values would double or halve the global batch of a run resumed without memopt, and a run under memopt that took a
plain checkpoint's per-device batch would train on a fraction of the script's. So:

- while a checkpoint or the model is saved, the arguments and the state hold the script's values
  (``per_device_train_batch_size``, ``gradient_accumulation_steps``, ``auto_find_batch_size`` and the loader's batch);
- under memopt, ``auto_find_batch_size`` is off: memopt recovers from out-of-memory errors itself (it shrinks the
  micro-batch, never the global batch), and a checkpoint's batch size is not restored over the script's batch.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

__all__ = ["ScriptBatch", "save_as_script"]

_FIELDS = ("per_device_train_batch_size", "gradient_accumulation_steps", "auto_find_batch_size")


class ScriptBatch:
    """The script's batch arguments and its loader's batch size, read before memopt sets its own."""

    def __init__(self, trainer: Any) -> None:
        self.arguments = {k: getattr(trainer.args, k) for k in _FIELDS if hasattr(trainer.args, k)}
        self.loader_batch = getattr(trainer, "_train_batch_size", None) or trainer.args.train_batch_size

    @contextlib.contextmanager
    def in_force(self, trainer: Any) -> Iterator[None]:
        """The script's values on ``trainer``'s arguments and state while inside; memopt's again after."""
        args, state = trainer.args, getattr(trainer, "state", None)
        running = {k: getattr(args, k) for k in self.arguments}
        loader = getattr(state, "train_batch_size", None)
        for key, value in self.arguments.items():
            setattr(args, key, value)
        if state is not None:
            state.train_batch_size = self.loader_batch
        try:
            yield
        finally:
            for key, value in running.items():
                setattr(args, key, value)
            if state is not None:
                state.train_batch_size = loader


def save_as_script(trainer: Any, script: ScriptBatch) -> None:
    """``trainer`` saves its checkpoints and its model with the script's batch values (see the module's doc), and
    trains with ``auto_find_batch_size`` off."""
    trainer.args.auto_find_batch_size = False
    for name in ("_save_checkpoint", "save_model"):
        original = getattr(trainer, name, None)
        if original is None:
            continue

        def saving(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            with script.in_force(trainer):
                return _original(*args, **kwargs)

        setattr(trainer, name, functools.wraps(original)(saving))
