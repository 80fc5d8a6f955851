"""Where the bytes of one real training step go, measured: module, op and category of every allocation.

``StepAttribution`` is a context manager around ONE step (``memopt.wrap`` records one per run when it writes a
run directory). Inside it a ``MemoryTracker`` (a dispatch mode: every storage an op creates, counted as the CUDA
allocator rounds it, until its last reference dies) records each allocation with the module running at the
time (``memopt.profile.attribution.ModuleAttribution``: module hooks in forward, autograd-node labels in
backward, the checkpointed block's submodules during recomputation) and the op; the block markers of the
profile name the position in the model, so groups are derived exactly as the prediction derives them. On a GPU
the caching allocator's counter is read around every op too: bytes an op leaves allocated that are no tensor
it returned (a cuBLAS workspace on first use) are counted as that op's temporaries, and the allocator's own
peak for the step is kept beside the attributed one. On the CPU the same mechanism runs over CPU tensors, so
the whole flow is testable without a GPU.

At the end of the step the live set at the step's highest point is tabulated by group, module and category
(``attribution_measured.json``); an out-of-memory error raised inside an op while recording is caught on its
way out (and re-raised): the module and op that failed and what was live by group and category at that moment
go to ``attribution_oom.json``, which the post-mortem compares with the plan
(``memopt.guard.attribution_postmortem``). ``memopt.guard.attribution_hooks`` records a step of ``memopt.wrap``
and of a Hugging Face Trainer.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memopt.blocks import find_block_stacks
from memopt.categories import MemoryCategory
from memopt.estimate.attribution import AttributionTable
from memopt.estimate.event_levels import downsample
from memopt.guard.allocator_history import AllocatorHistory, cuda_allocated_bytes
from memopt.profile.attribution import (
    EMBEDDING,
    OPTIMIZER,
    RUNTIME,
    ModuleAttribution,
    block_pattern,
    group_of,
    iter_tensors_shallow,
)
from memopt.profile.markers import install_markers
from memopt.profile.tracker import ALLOC, MemoryTracker
from memopt.units import allocator_size

__all__ = ["MEASURED_FILE", "OOM_FILE", "StepAttribution"]

Cat = MemoryCategory
MEASURED_FILE = "attribution_measured.json"
OOM_FILE = "attribution_oom.json"
_GROUPS_TAIL = ["between stacks", "head and loss", OPTIMIZER, RUNTIME]


class _Recorder(MemoryTracker):
    """The tracker, plus (on CUDA) the allocator's bytes an op keeps that are no tensor of its outputs, and the
    failing op of an out-of-memory error."""

    def __init__(self, device_type: str, owner: StepAttribution) -> None:
        super().__init__(device_type, record=True)
        self.owner = owner
        self.cuda = device_type == "cuda"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if not self.record:
            return func(*args, **(kwargs or {}))
        before = cuda_allocated_bytes() if self.cuda else 0
        tracked = self.current_bytes
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        except torch.OutOfMemoryError as exc:
            self.owner._failed(func.__name__, exc)
            raise
        if self.cuda:
            extra = (cuda_allocated_bytes() - before) - (self.current_bytes - tracked)
            if extra > 0:
                self.persistent(extra, func.__name__, Cat.TEMPORARIES)
        return out


def _owners(model: nn.Module) -> dict[int, str]:
    return {id(p): name.rpartition(".")[0] for name, p in model.named_parameters()}


class StepAttribution:
    """Record one step of ``model`` (see the module docstring). ``on_phase`` must receive the train step's phases
    ("forward[i]", "backward[i]", "optimizer", "zero_grad"). ``write(run_dir)`` writes the measured table."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, *, device_type: str,
                 step: int = 0, strategy: str = "", master: Any = None, batch: Any = None,
                 run_dir: str | os.PathLike[str] | None = None, plan_file: str = "plan.json", top: int = 10) -> None:
        self.model, self.optimizer, self.master = model, optimizer, master
        self.device_type = device_type
        self.step, self.strategy, self.batch, self.top = step, strategy, batch, top
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.snapshot_dir = self.run_dir  # where the allocator's snapshot of the step goes (CUDA)
        self.plan_file = plan_file
        self.stack_paths = [s.path for s in find_block_stacks(model)]
        self.tracker = _Recorder(device_type, self)
        self.failure: dict[str, Any] | None = None
        self.result: dict[str, Any] | None = None
        self._static: dict[int, tuple[str, str, MemoryCategory]] = {}  # key -> (group, module, category)
        self._grad_keys: dict[int, str] = {}
        self._opt_phase: int | None = None
        self._undo: list[Any] = []
        self._untracked_start = 0
        self._start_bytes = 0
        self._first_event = 0
        self._history = AllocatorHistory()

    # -- phases ----------------------------------------------------------------------------------------------
    def on_phase(self, name: str) -> None:
        if name == "optimizer" and self._opt_phase is None:
            self._grad_keys = self._keys_of_grads()
            self._opt_phase = len(self.tracker.run.phases)
        self.tracker.set_phase(name)

    def _phase_name(self) -> str:
        return self.tracker.run.phases[self.tracker._phase]

    def _keys_of_grads(self) -> dict[int, str]:
        owners = _owners(self.model)
        out = {}
        for p in self.model.parameters():
            if p.grad is not None and (k := self.tracker.key_of(p.grad)) is not None:
                out[k] = owners.get(id(p), "")
        return out

    # -- the recorded region -------------------------------------------------------------------------------
    def __enter__(self) -> StepAttribution:
        t = self.tracker
        owners = _owners(self.model)
        t.__enter__()
        self.attrib = ModuleAttribution(self.model, self._phase_name)
        t.module_fn = self.attrib.current
        self._undo.append(self.attrib.remove)
        self._undo.append(install_markers(find_block_stacks(self.model), t.set_phase))

        def static(tensor: Any, module: str, cat: MemoryCategory, label: str) -> None:
            if isinstance(tensor, torch.Tensor) and tensor.device.type == self.device_type:
                t.track(tensor, cat, label)
                k = t.key_of(tensor)
                if k is not None and k not in self._static:
                    self._static[k] = (module, label, cat)

        for name, p in self.model.named_parameters():
            static(p, name.rpartition(".")[0], Cat.PARAMETERS, "parameter")
            if p.grad is not None:
                static(p.grad, name.rpartition(".")[0], Cat.GRADIENTS, "gradient")
        for name, b in self.model.named_buffers():
            static(b, name.rpartition(".")[0], Cat.PARAMETERS, "buffer")
        if self.master is not None:
            for p, m in zip(self.master.params, self.master.masters):
                static(m, owners.get(id(p), ""), Cat.OPTIMIZER_STATES, "fp32 master copy")
        if self.optimizer is not None:
            master_of = {id(m): p for p, m in zip(self.master.params, self.master.masters)} if self.master else {}
            for p, state in self.optimizer.state.items():
                owner = owners.get(id(master_of.get(id(p), p)), "")
                for v in state.values():
                    static(v, owner, Cat.OPTIMIZER_STATES, "optimizer state")
        for v in iter_tensors_shallow(self.batch):
            static(v, "(input batch)", Cat.ACTIVATIONS, "input")
        self._start_bytes = t.current_bytes
        if t.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._untracked_start = max(cuda_allocated_bytes() - t.current_bytes, 0)
            self._history.begin()
        t.set_phase("step")
        self._first_event = len(t.run.events)
        return self

    def __exit__(self, *exc: Any) -> None:
        t = self.tracker
        try:
            if exc[0] is None and self.failure is None:
                self.result = self._tabulate()
                if t.cuda:
                    self.result["allocator_peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
        finally:
            if t.cuda:
                snapshot = (self.snapshot_dir / f"attribution_step{self.step}_snapshot.pickle"
                            if self.snapshot_dir is not None else None)
                try:
                    history = self._history.end(snapshot)
                except Exception:  # the history is a cross-check; the step's own record stands without it
                    history = None
                if history is not None and self.result is not None:
                    self.result["allocator_history"] = history
            t.record = False
            for undo in reversed(self._undo):
                undo()
            self._undo = []
            t.__exit__(*exc)
        if self.run_dir is not None:
            self.write(self.run_dir)

    # -- what was live ---------------------------------------------------------------------------------------
    def _classify(self) -> tuple[dict[int, MemoryCategory], dict[int, str]]:
        """Category of every key allocated in the step (the prediction's lifetime rule) and its module."""
        run = self.tracker.run
        end = self._opt_phase if self._opt_phase is not None else len(run.phases)
        in_bwd: dict[int, bool] = {}
        freed_bwd: set[int] = set()
        alive: set[int] = set()
        for kind, key, _, ph, _ in run.events:
            name = run.phases[ph]
            if ph >= end:
                continue
            bwd = name.startswith(("bwd:", "backward"))
            if kind == ALLOC:
                in_bwd[key] = bwd
                alive.add(key)
            else:
                alive.discard(key)
                if bwd:
                    freed_bwd.add(key)
        states = set()
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor) and (k := self.tracker.key_of(v)) is not None:
                        states.add(k)
        cats: dict[int, MemoryCategory] = {}
        modules: dict[int, str] = {}
        owners = _owners(self.model)
        state_owner: dict[int, str] = {}
        if self.optimizer is not None:
            for p, state in self.optimizer.state.items():
                for v in state.values():
                    if isinstance(v, torch.Tensor) and (k := self.tracker.key_of(v)) is not None:
                        state_owner[k] = owners.get(id(p), "")
        for kind, key, _, _, _ in run.events:
            if kind != ALLOC or key in self._static:
                continue
            if key in self._grad_keys:
                cats[key], modules[key] = Cat.GRADIENTS, self._grad_keys[key]
            elif key in states:
                cats[key], modules[key] = Cat.OPTIMIZER_STATES, state_owner.get(key, "")
            elif key in run.persistent_keys:
                cats[key] = Cat.TEMPORARIES
            elif key in in_bwd and not in_bwd[key] and (key in freed_bwd or key in alive):
                cats[key] = Cat.ACTIVATIONS
            else:
                cats[key] = Cat.TEMPORARIES
        return cats, modules

    def _live_table(self, upto: int) -> dict[str, Any]:
        """What was live after event ``upto`` of the run (the tensors tracked before the step included), by
        group, module and category."""
        run = self.tracker.run
        cats, modules = self._classify()
        live: dict[int, tuple[int, int, int]] = {}
        for kind, key, size, ph, label in run.events[:upto + 1]:
            if kind == ALLOC:
                live[key] = (size, ph, label)
            else:
                live.pop(key, None)
        return self._table(live, cats, modules)

    def _table(self, live: dict[int, tuple[int, int, int]], cats: dict[int, MemoryCategory],
               modules: dict[int, str]) -> dict[str, Any]:
        run = self.tracker.run
        table = AttributionTable()
        first = self.attrib.first_phase
        order = self.attrib.order
        for key, (size, ph, label) in live.items():
            nbytes = allocator_size(size)
            phase = run.phases[ph]
            if key in self._static:
                module, op, cat = self._static[key]
                group = EMBEDDING if module == "(input batch)" else group_of(module, "forward", self.stack_paths,
                                                                             first, order)
                _, _, pattern = block_pattern(module, self.stack_paths)
                table.add(group, pattern or "(root)", cat, nbytes, op=op, tensor_path=module or "(root)")
                continue
            cat = cats.get(key, Cat.TEMPORARIES)
            module = modules.get(key, run.alloc_module.get(key, ""))
            op = run.labels[label] if 0 <= label < len(run.labels) else ""
            if key in run.persistent_keys:
                table.add(RUNTIME, "(workspaces)", cat, nbytes, op=op,
                          tensor_path=f"(workspace, first used in {module or 'no module'})")
                continue
            if phase == "step" and not module:  # the batch staged onto the device before the first forward
                table.add(EMBEDDING, "(input batch)", cat, nbytes, op=op, phase=phase, tensor_path="(input batch)")
                continue
            if phase.startswith(("optimizer", "zero_grad")) and cat != Cat.OPTIMIZER_STATES:
                group = OPTIMIZER
            else:
                group = group_of(module, phase if cat != Cat.GRADIENTS and cat != Cat.OPTIMIZER_STATES
                                 else "forward", self.stack_paths, first, order)
            _, _, pattern = block_pattern(module, self.stack_paths)
            if group == OPTIMIZER and not module:
                pattern = "(optimizer step)"
            table.add(group, pattern or "(root)", cat, nbytes, op=op, phase=phase, tensor_path=module or "(root)")
        if self._untracked_start:
            table.add(RUNTIME, "(allocated before the step, no tensor seen)", Cat.TEMPORARIES, self._untracked_start,
                      op="untracked", tensor=False)
        groups = [EMBEDDING, *self.stack_paths, *_GROUPS_TAIL]
        return table.result(groups, self.top)

    def _tabulate(self) -> dict[str, Any]:
        run = self.tracker.run
        level = self._start_bytes
        at = self._first_event - 1
        best = level
        for i in range(self._first_event, len(run.events)):
            kind, _, size, _, _ = run.events[i]
            level += allocator_size(size) if kind == ALLOC else -allocator_size(size)
            if level > best:
                best, at = level, i
        out = self._live_table(at)
        out.update({"step": self.step, "strategy": self.strategy, "device": self.device_type,
                    "method": "per-tensor dispatch tracker with module hooks"
                              + (" and the CUDA allocator's counter per op" if self.tracker.cuda else ""),
                    "peak_allocated_bytes": out["total_bytes"], "plan_file": self.plan_file,
                    "timeline": self._timeline()})
        return out

    def _timeline(self) -> dict[str, Any]:
        run = self.tracker.run
        level = self._start_bytes + self._untracked_start
        levels: list[int] = []
        phases: list[tuple[str, int]] = []
        last = ""
        for i, (kind, _key, size, ph, _label) in enumerate(run.events[self._first_event:]):
            level += allocator_size(size) if kind == ALLOC else -allocator_size(size)
            levels.append(level)
            name = run.phases[ph]
            kind_name = ("optimizer" if name.startswith(("optimizer", "zero_grad")) else
                         "backward" if name.startswith(("bwd:", "backward")) else
                         "forward" if name.startswith(("fwd:", "forward")) else "")
            if kind_name and kind_name != last:
                phases.append((kind_name, i))
                last = kind_name
        return downsample(levels, phases)

    # -- failure -------------------------------------------------------------------------------------------------
    def _failed(self, op: str, exc: BaseException) -> None:
        if self.failure is not None:
            return
        t = self.tracker
        t.record = False
        module = self.attrib.current()
        phase = self._phase_name()
        table = self._live_table(len(t.run.events) - 1)
        group = group_of(module, phase, self.stack_paths, self.attrib.first_phase, self.attrib.order)
        self.failure = {"step": self.step, "strategy": self.strategy, "module": module or "(root)", "op": op,
                        "phase": phase, "group": group, "message": str(exc).splitlines()[0][:300],
                        "plan_file": self.plan_file, **table}

    def write(self, run_dir: str | os.PathLike[str], *, rank: int = 0) -> None:
        d = Path(run_dir)
        d.mkdir(parents=True, exist_ok=True)
        suffix = "" if rank == 0 else f".rank{rank}"
        if self.result is not None:
            (d / MEASURED_FILE.replace(".json", f"{suffix}.json")).write_text(json.dumps(self.result, default=str))
        if self.failure is not None:
            path = d / OOM_FILE.replace(".json", f"{suffix}.json")
            previous = json.loads(path.read_text()) if path.exists() else []
            path.write_text(json.dumps([*previous, self.failure], default=str))
