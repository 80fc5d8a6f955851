"""A training step simulated on fake tensors, with the strategy applied for real.

This is memopt's ground truth on a machine without a GPU: the user's model (copied onto fake
tensors), ``prepare`` applying every technique exactly as ``wrap`` does, ``TrainStep`` running
forward, backward and the optimizer step, and a ``MemoryTracker`` counting every byte the GPU would
allocate (CUDA semantics emulated where CPU dispatch differs; see ``cuda_semantics``).

It is also how the profile records its traces: run on a copy whose block stacks are truncated, with
phase markers at block boundaries.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memopt.blocks import find_block_stacks
from memopt.categories import MemoryCategory
from memopt.profile.cuda_semantics import KernelPolicy, trace_semantics
from memopt.profile.fake_model import fake_copy, grads_kept, train_as_given, truncate_stacks
from memopt.profile.hf_compat import real_code_paths
from memopt.profile.loss_key import modules_in
from memopt.profile.markers import install_markers
from memopt.profile.process_caches import caches_kept_real
from memopt.profile.scalar_values import ShadowFormatting
from memopt.profile.stand_ins import TRACE_STAND_INS
from memopt.profile.tracker import MemoryTracker, TrackedRun
from memopt.step.batch import check_batch
from memopt.step.batch_tree import tensors as batch_tensors
from memopt.step.prepare import OptimizerSpec, prepare
from memopt.step.train_step import LossFn
from memopt.strategy import Strategy

__all__ = ["SimulationResult", "simulate_step", "trace_device"]


def trace_device(policy: KernelPolicy) -> tuple[str, bool]:
    """(device to trace on, whether CUDA semantics must be emulated).

    Every machine traces CPU fake tensors under the CUDA-semantics layer, a GPU machine too: it is the path that
    the H200 measurements validate and CI replays, so a plan made beside the GPU is the plan the dry run makes.
    Fake CUDA tensors followed other code paths and under-counted (OPT-350m: 8.5 GiB predicted where the emulated
    trace predicts 15.4 and the H200 ran out of memory at 11.2). ``MEMOPT_TRACE_DEVICE=cuda`` still selects them,
    on a GPU of the planned architecture, to compare the two."""
    if os.environ.get("MEMOPT_TRACE_DEVICE") == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        if major * 10 + minor == policy.attention.sm:
            return "cuda", False
    return "cpu", True


@dataclass
class SimulationResult:
    """What a simulated run allocated."""

    peak_allocated_bytes: int
    run: TrackedRun
    device: str
    emulated: bool
    attention_backends: list[str] = field(default_factory=list)
    step_peaks: list[int] = field(default_factory=list)  # peak of each optimizer step
    wall_s: float = 0.0
    full_block_counts: list[int] = field(default_factory=list)  # per stack, before truncation

    def phase_names(self) -> list[str]:
        return list(self.run.phases)


def _make_fake_batch(batch_factory: Any, device: str) -> Any:
    batch = batch_factory(device)
    check_batch(batch)  # any structure of the batch contract (memopt.step.batch)
    return batch


def simulate_step(model: nn.Module, batch_factory: Any, strategy: Strategy, *, policy: KernelPolicy,
                  num_steps: int = 2, optimizer: OptimizerSpec = None,
                  optimizer_kwargs: dict[str, Any] | None = None, loss_fn: LossFn | None = None,
                  truncate_to: int | None = None, markers: bool = False) -> SimulationResult:
    """Simulate ``num_steps`` optimizer steps of ``model`` under ``strategy`` on fake tensors.

    ``batch_factory(device)`` returns the *global* batch (created inside fake mode, so tensors are fake).
    ``truncate_to`` shortens every block stack to that many blocks (profile traces); ``markers`` records
    block-boundary phases in the run.
    """
    device, emulate = trace_device(policy)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    start = time.perf_counter()
    clone = fake_copy(model, fake_mode, device)
    full_counts = [len(s) for s in find_block_stacks(clone)]
    if truncate_to is not None:
        truncate_stacks(clone, keep=truncate_to)
    train_as_given(clone, model)
    tracker = MemoryTracker(device)
    attention_log: list[str] = []
    step_peaks: list[int] = []
    semantics = trace_semantics(policy, tracker, attention_log, emulate=emulate)
    host = "meta" if emulate else "cpu"
    with caches_kept_real(model), grads_kept(model, *modules_in(loss_fn)), fake_mode, semantics, real_code_paths():
        prepared = prepare(clone, strategy, device_type=device, device=None, optimizer=optimizer,
                           optimizer_kwargs=optimizer_kwargs, loss_fn=loss_fn, stand_ins=TRACE_STAND_INS,
                           host_device=host)
        remove_markers = install_markers(prepared.stacks, tracker.set_phase) if markers else None
        prepared.step.on_phase = tracker.set_phase
        try:
            with tracker, ShadowFormatting(tracker.shadows):
                for p in clone.parameters():
                    tracker.track(p, MemoryCategory.PARAMETERS, "parameter")
                for b in clone.buffers():
                    tracker.track(b, MemoryCategory.PARAMETERS, "buffer")
                if prepared.step.master is not None:
                    for m in prepared.step.master.masters:
                        tracker.track(m, MemoryCategory.OPTIMIZER_STATES, "master_weight")
                batch = _make_fake_batch(batch_factory, device)
                for v in batch_tensors(batch):
                    tracker.track(v, MemoryCategory.ACTIVATIONS, "input")
                for _ in range(num_steps):
                    tracker.set_phase("step")
                    tracker.reset_peak()
                    prepared.step.step(batch)
                    step_peaks.append(tracker.peak_bytes)
                    _categorize_states(tracker, prepared.optimizer)
        finally:
            if remove_markers is not None:
                remove_markers()
            prepared.undo()
    return SimulationResult(peak_allocated_bytes=max(step_peaks) if step_peaks else tracker.peak_bytes,
                            run=tracker.run, device=device, emulated=emulate, attention_backends=attention_log,
                            step_peaks=step_peaks, wall_s=time.perf_counter() - start,
                            full_block_counts=full_counts)


def _categorize_states(tracker: MemoryTracker, optimizer: torch.optim.Optimizer) -> None:
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                tracker.categorize(value, MemoryCategory.OPTIMIZER_STATES)
