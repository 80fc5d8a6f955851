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


def test_a_neighbour_missing_from_one_listing_is_not_taken_for_this_process(monkeypatch):
    """Two reads of the driver: in the first a starting neighbour holds 8 GiB but is not listed yet; in the second
    it is. Each read alone is what NVML said; the least of them is this process's 1 GiB."""
    listings = iter([[(7, 4 * GiB)], [(7, 4 * GiB), (8, 8 * GiB)]])
    _driver(monkeypatch, [], used=13 * GiB)
    sys.modules["pynvml"].nvmlDeviceGetComputeRunningProcesses = lambda handle: [
        types.SimpleNamespace(pid=pid, usedGpuMemory=mem) for pid, mem in next(listings)]
    assert process_device_bytes(samples=2, interval_s=0) == 1 * GiB


def test_one_read_keeps_what_that_listing_says(monkeypatch):
    _driver(monkeypatch, [(7, 4 * GiB)], used=13 * GiB)  # the neighbour at 8 GiB is not listed: counted as ours
    assert process_device_bytes() == 9 * GiB
