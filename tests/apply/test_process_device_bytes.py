"""This process's device memory when NVML does not list it: the device's used memory less every other process's.

NVML is the driver's report; here a stand-in module plays a driver that lists five other processes and not this
one (as an H200 did for a process that had just made its context)."""

from __future__ import annotations

import os
import sys
import types

import torch

from memopt.step.hard_cap import process_device_bytes

GiB = 2**30


def _driver(monkeypatch, procs: list[tuple[int, int | None]], used: int, total: int = 140 * GiB) -> None:
    nvml = types.ModuleType("pynvml")
    nvml.nvmlInit = lambda: None
    nvml.nvmlDeviceGetHandleByIndex = lambda index: index
    nvml.nvmlDeviceGetComputeRunningProcesses = lambda handle: [
        types.SimpleNamespace(pid=pid, usedGpuMemory=mem) for pid, mem in procs]
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total - used, total))


def test_listed_process_reads_its_own_figure(monkeypatch):
    _driver(monkeypatch, [(os.getpid(), 3 * GiB), (1, 9 * GiB)], used=12 * GiB)
    assert process_device_bytes() == 3 * GiB


def test_unlisted_process_is_the_used_memory_less_the_others(monkeypatch):
    others = [(100 + i, (2 + i) * GiB) for i in range(5)]  # 20 GiB held by five other processes
    _driver(monkeypatch, [*others, (os.getpid(), None)], used=21 * GiB)
    assert process_device_bytes() == 1 * GiB  # not 21 GiB: the others' memory is not this process's runtime


def test_alone_on_the_device_or_others_unknown_is_left_to_the_device_figure(monkeypatch):
    _driver(monkeypatch, [], used=5 * GiB)
    assert process_device_bytes() is None
    _driver(monkeypatch, [(7, None)], used=5 * GiB)
    assert process_device_bytes() is None
