"""``scripts/wrap_sharded_gpu.py``'s reading of the allocator history: each stream's allocated peak, what was live in
that stream at its peak, and the bytes its pool mapped, on a trace worked out by hand."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _stream_peaks():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from wrap_sharded_gpu import stream_peaks
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return stream_peaks


def test_stream_peaks_by_hand() -> None:
    default, side = 11, 22
    ev = [
        {"action": "segment_map", "addr": 0, "size": 100, "stream": default},
        {"action": "alloc", "addr": 1, "size": 10, "stream": default},
        {"action": "segment_map", "addr": 200, "size": 60, "stream": side},
        {"action": "alloc", "addr": 2, "size": 30, "stream": side},
        {"action": "alloc", "addr": 3, "size": 5, "stream": default},  # default's peak: 15, everything 45
        {"action": "free_requested", "addr": 2, "size": 30, "stream": side},  # not yet free
        {"action": "free_completed", "addr": 2, "size": 30, "stream": side},
        {"action": "alloc", "addr": 4, "size": 50, "stream": side},  # side's peak: 50, everything 65
        {"action": "segment_unmap", "addr": 200, "size": 60, "stream": side},
        {"action": "segment_map", "addr": 300, "size": 40, "stream": side},  # mapped peak stays 60
    ]
    got = _stream_peaks()({"device_traces": [ev]}, 0, default)
    assert [p["stream"] for p in got] == ["default", "22"]  # the default stream first
    d, s = got
    assert (d["peak_allocated_bytes"], d["at_event"], d["all_streams_allocated_then"]) == (15, 4, 45)
    assert d["live_sizes"] == [10, 5] and d["mapped_peak_bytes"] == 100
    assert (s["peak_allocated_bytes"], s["at_event"], s["all_streams_allocated_then"]) == (50, 7, 65)
    assert s["live_sizes"] == [50] and s["live_count"] == 1 and s["mapped_peak_bytes"] == 60


def test_live_at_peak_sums_what_was_alive_then_by_the_code_that_made_it() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from allocation_history import live_at_peak
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    block = [{"filename": "/x/site-packages/transformers/models/t5/modeling_t5.py", "line": 7, "name": "forward"}]
    ours = [{"filename": "/repo/memopt/step/train_step.py", "line": 3, "name": "step"}]
    ev = [
        {"action": "alloc", "addr": 1, "size": 10, "frames": ours},
        {"action": "alloc", "addr": 2, "size": 30, "frames": block},
        {"action": "alloc", "addr": 3, "size": 20, "frames": block},  # the peak: 60
        {"action": "free_requested", "addr": 3, "size": 20, "frames": block},  # not yet free
        {"action": "free_completed", "addr": 3, "size": 20, "frames": block},
        {"action": "alloc", "addr": 4, "size": 15, "frames": ours},  # 55: below the peak
    ]
    got = live_at_peak({"device_traces": [ev]}, 0)
    assert (got["recorded_peak_bytes"], got["peak_event"], got["events"]) == (60, 2, 6)
    assert got["sites"] == [{"site": "transformers/models/t5/modeling_t5.py:7 forward", "bytes": 50, "count": 2},
                            {"site": "/repo/memopt/step/train_step.py:3 step", "bytes": 10, "count": 1}]
