"""A ground truth for the FSDP2 memory model: run FSDP2 on fake tensors with a fake process group.

PyTorch's ``FSDPMemTracker`` (``torch.distributed._tools.fsdp2_mem_tracker``) attributes every storage
to a category (sharded / unsharded parameters and gradients, all-gather and reduce-scatter buffers,
optimizer states, activations, temporaries). Run under ``FakeTensorMode`` with the ``fake`` process
group (``torch.testing._internal.distributed.fake_pg.FakeStore``), one process stands for rank 0 of a
``world_size``-rank job, on the CPU, without allocating the model. Collectives return without moving
data and the single stream serializes everything, so overlap between the communication and compute
streams of a GPU is not seen (the estimator's ``forward_overlap=False`` corresponds to it).

``simulate_fsdp2`` records, besides the tracker's snapshot at the peak of all bytes (and the modules
running then), the highest value over the run of "model states + buffers" (everything except
activations, temporaries and inputs) and its breakdown at that moment. Each step clears the gradients
with ``zero_grad(set_to_none=True)`` as ``memopt``'s train steps do, so with one micro-batch per step
(``grad_accum=1``) the sharded gradients appear only as backward reduce-scatters them; with more, every
micro-batch after the first runs with all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from copy import deepcopy
from typing import Any

import torch
from torch import nn

from memopt.distributed.torch_engines import apply_fsdp2
from memopt.techniques.sharding import ShardingSetting

__all__ = ["STATE_KEYS", "simulate_fsdp2"]

#: the tracker's categories counted as model states and buffers
STATE_KEYS = ("Sharded Param", "Unsharded Param", "Buffer", "Sharded Grad", "Unsharded Grad", "All Gather",
              "Reduce Scatter", "OptState")


def simulate_fsdp2(build_model: Callable[[], nn.Module], make_batch: Callable[[], dict[str, Any] | tuple],
                   *, world_size: int, setting: Any = None, mp_policy: Any = None, steps: int = 2,
                   grad_accum: int = 1,
                   loss_fn: Callable[[Any], torch.Tensor] | None = None,
                   optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None) -> dict[str, Any]:
    """Simulate ``steps`` FSDP2 training steps of rank 0 of ``world_size`` on fake tensors.

    ``build_model`` is called inside ``FakeTensorMode`` (build on the CPU device); ``setting`` is a
    ``ShardingSetting`` (engine fsdp2; its world size is replaced by ``world_size``); ``grad_accum``:
    forward/backward passes of the batch per optimizer step. Returns ``{"peak": {category: bytes},
    "peak_where": [module names running at the peak], "states_peak": int, "states_breakdown": {category: bytes},
    "states_where": [...]}`` (``peak`` includes the tracker's ``"Total"``).
    Initializes (and destroys) the default process group with the fake backend: do not call it inside
    a real distributed job.
    """
    import dataclasses

    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    setting = ShardingSetting.from_any(setting or {"engine": "fsdp2", "stage": 3})
    setting = dataclasses.replace(setting, world_size=world_size, nodes=1, replicate_size=1)
    if dist.is_initialized():
        raise RuntimeError("simulate_fsdp2 needs its own (fake) default process group; a process group is already up")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        with FakeTensorMode():
            model = build_model()
            apply_fsdp2(model, setting, mp_policy, device_type="cpu", mesh=mesh)
            opt = (optimizer or (lambda ps: torch.optim.AdamW(ps, lr=1e-3)))(list(model.parameters()))
            batch = make_batch()
            tracker = _StatesTracker(model, opt)
            tracker.track_inputs(tuple(batch.values()) if isinstance(batch, dict) else tuple(batch))
            with tracker:
                for _ in range(steps):
                    for _ in range(grad_accum):
                        out = model(**batch) if isinstance(batch, dict) else model(*batch)
                        loss = loss_fn(out) if loss_fn else out.float().mean()
                        loss.backward()
                        del out, loss
                        tracker.reset_mod_stats()  # the tracker follows one forward/backward per module at a time
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            peak = tracker.get_tracker_snapshot("peak")
    finally:
        dist.destroy_process_group()
    dev = next(iter(peak))
    return {"peak": {str(getattr(k, "value", k)): v for k, v in peak[dev].items()},
            "peak_where": tracker.peak_where, "states_peak": tracker.states_peak,
            "states_breakdown": tracker.states_breakdown, "states_where": tracker.states_where}


def _make_tracker_class() -> type:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    class StatesTracker(FSDPMemTracker):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.states_peak = 0
            self.states_breakdown: dict[str, int] = {}
            self.states_where: list[str] = []
            self.peak_where: list[str] = []
            self._total_peak = 0

        def _update_peak_stats(self, peak_state: Any) -> None:
            super()._update_peak_stats(peak_state)
            for snap in self._curr_mem_snap.values():
                total = sum(v for k, v in snap.items() if str(getattr(k, "value", k)) != "Total")
                if total > self._total_peak:
                    self._total_peak = total
                    self.peak_where = sorted(self._mod_tracker.parents)
                named = {str(getattr(k, "value", k)): v for k, v in snap.items()}
                total = sum(named.get(k, 0) for k in STATE_KEYS)
                if total > self.states_peak:
                    self.states_peak = total
                    self.states_breakdown = deepcopy({k: named.get(k, 0) for k in STATE_KEYS})
                    self.states_where = sorted(self._mod_tracker.parents)

    return StatesTracker


class _StatesTrackerProxy:
    """Built lazily so importing this module does not import the distributed tools."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        return _make_tracker_class()(*args, **kwargs)


_StatesTracker = _StatesTrackerProxy
