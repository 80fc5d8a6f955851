"""The rows each optimizer step of a wrapped ``Trainer`` trains on: the script's, with ``dataloader_drop_last`` too.

memopt gives the Trainer's loader a per-device batch of its own (the process's whole global batch, split inside
``training_step``; or the plan's micro-batch), where the script's loader batches ``per_device_train_batch_size``
rows and the Trainer accumulates ``gradient_accumulation_steps`` of them per optimizer step. Both walk the same
sampler order, and the Trainer's last accumulation window of an epoch holds what is left (it steps on fewer
batches), so each optimizer step covers the same rows either way, and an epoch has as many steps. Except for what
``dataloader_drop_last`` drops: the script's loader drops the epoch's last partial batch of its own size (fewer
than ``per_device_train_batch_size`` rows), a loader of memopt's batch would drop a partial batch of memopt's size:
other rows, and fewer steps and a shorter schedule.

So where the batch differs and ``drop_last`` is set, the training loader memopt's Trainer builds keeps the rows
the script's loader keeps, the sampler's first whole multiple of the script's batch, and drops nothing after them
(``keep_script_rows``). One process with a sized dataset, the loader the Trainer builds: its batch sampler is
torch's, after accelerate's ``prepare`` (which swapped a random sampler for its seedable one, as for the script's
loader). Anything else (an iterable dataset, several processes, a loader of the script's own) is left as built,
with a warning saying which rows may differ.
"""

from __future__ import annotations

import functools
import itertools
import warnings
from collections.abc import Iterator
from typing import Any

from torch.utils.data import BatchSampler, IterableDataset, Sampler

__all__ = ["ScriptRows", "keep_script_rows"]


class ScriptRows(Sampler[int]):
    """The first indices of ``sampler`` that whole batches of ``batch`` rows hold: what a loader of ``batch`` with
    ``drop_last`` trains on."""

    def __init__(self, sampler: Any, batch: int) -> None:
        self.sampler = sampler
        self.batch = batch

    def __len__(self) -> int:
        return len(self.sampler) // self.batch * self.batch

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.sampler), len(self))

    def set_epoch(self, epoch: int) -> None:
        """The epoch to the sampler inside (accelerate's seedable sampler draws its order from it)."""
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


def keep_script_rows(trainer: Any, script_batch: int) -> None:
    """``trainer.get_train_dataloader`` whose loader, while ``dataloader_drop_last`` is set and its batch is not
    ``script_batch`` (the script's per-device batch), trains on the rows a loader of ``script_batch`` keeps."""
    build = trainer.get_train_dataloader

    @functools.wraps(build)
    def get_train_dataloader(*args: Any, **kwargs: Any) -> Any:
        loader = build(*args, **kwargs)
        if trainer.args.dataloader_drop_last:
            _drop_as_script(loader, script_batch, max(1, getattr(trainer.args, "world_size", 1)))
        return loader

    trainer.get_train_dataloader = get_train_dataloader


def _drop_as_script(loader: Any, script_batch: int, world_size: int) -> None:
    sampler = getattr(loader, "batch_sampler", None)
    batch = getattr(sampler, "batch_size", None) or getattr(loader, "batch_size", None)
    if batch == script_batch:
        return
    sized = hasattr(sampler, "sampler") and hasattr(sampler.sampler, "__len__")
    if (type(sampler) is BatchSampler and sampler.drop_last and world_size == 1 and sized
            and not isinstance(getattr(loader, "dataset", None), IterableDataset)):
        # the batch sampler is the loader's own object: changed in place, since a DataLoader's batch_sampler is
        # fixed once built
        sampler.sampler = ScriptRows(sampler.sampler, script_batch)
        sampler.drop_last = False
        return
    warnings.warn(f"dataloader_drop_last=True with memopt's per-device batch of {batch} rows in place of the "
                  f"script's {script_batch}: with this loader ({type(loader).__name__} over "
                  f"{type(getattr(loader, 'dataset', None)).__name__}, {world_size} process(es)) memopt cannot drop "
                  "exactly the rows the script's loader drops, so the end of each epoch may train on other rows "
                  "and take another number of steps; set dataloader_drop_last=False, or make the dataset a "
                  "multiple of the global batch", UserWarning, stacklevel=3)
