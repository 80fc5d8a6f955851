"""What PyTorch's recorded allocation history says was alive at a GPU run's allocated peak, summed by the code
that allocated it (``torch.cuda.memory._record_memory_history`` then ``torch.cuda.memory._snapshot()``)."""

from __future__ import annotations

from collections.abc import Iterable


def allocation_site(frames: list[dict]) -> str:
    """Where an allocation was made: the innermost frame in DeepSpeed, memopt, transformers or PyTorch's
    distributed/autograd Python code (file:line function)."""
    keys = ("deepspeed/", "memopt/", "transformers/", "torch/distributed/", "torch/utils/checkpoint", "torch/nn/")
    for f in frames:
        name = f.get("filename", "")
        if any(k in name for k in keys):
            short = name.split("site-packages/")[-1]
            return f"{short}:{f.get('line')} {f.get('name')}"
    return frames[0].get("name", "?") if frames else "?"


def live_at_peak(snapshot: dict, device: int, top: int = 30) -> dict:
    """From the allocator's recorded history: the allocations live at the highest allocated point of the
    recorded events, summed by the code that made them (``allocation_site``)."""
    events = snapshot["device_traces"][device]
    cur = best = best_i = 0
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            cur += e["size"]
        elif e["action"] == "free_completed":
            cur -= e["size"]
        if cur > best:
            best, best_i = cur, i
    live: dict[int, dict] = {}
    for e in events[: best_i + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    return {"recorded_peak_bytes": best, "events": len(events), "peak_event": best_i,
            "sites": by_site(((e["size"], e.get("frames", [])) for e in live.values()), top)}


def by_site(blocks: Iterable[tuple[int, list[dict]]], top: int = 30) -> list[dict]:
    """(bytes, frames) of live allocations summed by the code that made them, largest first."""
    sites: dict[str, list[int]] = {}
    for size, frames in blocks:
        acc = sites.setdefault(allocation_site(frames), [0, 0])
        acc[0] += size
        acc[1] += 1
    ordered = sorted(sites.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"site": k, "bytes": v[0], "count": v[1]} for k, v in ordered]
