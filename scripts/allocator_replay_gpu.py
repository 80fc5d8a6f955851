#!/usr/bin/env python3
"""Replay allocation traces on a real CUDA GPU and compare PyTorch's caching allocator with the simulator.

Usage (from the repository root, on a machine with a CUDA GPU)::

    python scripts/allocator_replay_gpu.py --out allocator_replay.json [trace.json ...] [--extra-configs]

For every trace and every allocator configuration (expandable segments off and on; with
``--extra-configs`` also max_split_size_mb, roundup_power2_divisions and a garbage-collection threshold)
a fresh Python subprocess is started with ``PYTORCH_CUDA_ALLOC_CONF`` set before CUDA initialises. It
replays the trace with ``torch.empty(size, dtype=torch.uint8, device='cuda')`` and ``del`` and records
``max_memory_allocated``, ``max_memory_reserved`` (and, for short traces, ``memory_reserved`` after every
event). The parent process runs ``memopt.estimate.allocator`` on the same trace and writes both to the
JSON file given by ``--out``, then prints a table.

Built-in traces (deterministic): hand-computed unit cases, a transformer-like training pattern
(activations growing through the forward pass, shrinking through the backward, with varying token counts),
many small tensors, a fragmentation-heavy random trace (fixed seed), a two-stream trace and a trace run
under ``torch.cuda.set_per_process_memory_fraction`` (two caps). A trace file is JSON: a list of events
``[kind, key, size]`` / ``[kind, key, size, stream]`` (kind 1 = alloc, -1 = free), or an object
``{"events": [...], "cap_bytes": int | null}``.

Exit status: 0 on success, 2 when no CUDA device is available.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from memopt.estimate.allocator import simulate_allocator  # noqa: E402
from memopt.estimate.allocator_config import AllocatorConfig  # noqa: E402
from memopt.estimate.allocator_sim import CachingAllocatorSim  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
DETAIL_LIMIT = 30_000  # traces up to this many events also record memory_reserved after every event

Event = tuple[int, ...]

CONFIGS: dict[str, AllocatorConfig] = {
    "default": AllocatorConfig(),
    "expandable": AllocatorConfig(expandable_segments=True),
}
EXTRA_CONFIGS: dict[str, AllocatorConfig] = {
    "max_split_128mb": AllocatorConfig(max_split_size_bytes=128 * MiB),
    "roundup_pow2_4": AllocatorConfig(roundup_power2_divisions=4),
    "gc_0.6": AllocatorConfig(garbage_collection_threshold=0.6),
    "expandable_max_split_128mb": AllocatorConfig(expandable_segments=True, max_split_size_bytes=128 * MiB),
}


# -- traces ---------------------------------------------------------------------------------------
class _Builder:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self.next_key = 0

    def alloc(self, size: int, stream: int = 0) -> int:
        key = self.next_key
        self.next_key += 1
        self.events.append((1, key, size, stream) if stream else (1, key, size))
        return key

    def free(self, key: int) -> None:
        self.events.append((-1, key, 0))


def unit_traces() -> dict[str, list[Event]]:
    """The hand-computed cases of tests/estimate/test_allocator.py."""
    out: dict[str, list[Event]] = {}
    b = _Builder()
    k = b.alloc(12 * MiB)
    b.free(k)
    b.alloc(6 * MiB)
    out["unit_reuse_12_then_6"] = b.events
    b = _Builder()
    a, _, c = b.alloc(12 * MiB), b.alloc(12 * MiB), b.alloc(12 * MiB)
    b.free(a)
    b.free(c)
    b.alloc(14 * MiB)
    out["unit_fragmentation"] = b.events
    b = _Builder()
    for _ in range(13):
        b.alloc(3 * MiB // 2)
    out["unit_pack_1.5mb"] = b.events
    b = _Builder()
    k = b.alloc(12 * MiB)
    b.free(k)
    b.alloc(12 * MiB, stream=1)
    b.alloc(12 * MiB)
    out["unit_streams"] = b.events
    b = _Builder()
    keys = [b.alloc(4 * MiB) for _ in range(3)]
    b.free(keys[0])
    b.free(keys[2])
    b.free(keys[1])
    b.alloc(20 * MiB)
    out["unit_merge"] = b.events
    b = _Builder()
    for size in (1, 511, 512, 513, 1 << 20, (1 << 20) + 1, 5 * MiB, 10 * MiB - 1, 10 * MiB, 10 * MiB + 1):
        b.alloc(size)
    out["unit_sizes"] = b.events
    return out


def transformer_trace(layers: int = 24, hidden: int = 2048, steps: int = 4, seed: int = 0) -> list[Event]:
    """Weights, then steps of forward (saved activations grow, temporaries come and go) and backward."""
    rng = random.Random(seed)
    b = _Builder()
    weights = []
    for _ in range(layers):
        for shape in ((hidden, 3 * hidden), (hidden, hidden), (hidden, 4 * hidden), (4 * hidden, hidden)):
            weights.append(b.alloc(shape[0] * shape[1] * 2))
        weights.append(b.alloc(hidden * 4))  # layer norm weight, fp32
    grads: list[int] = []
    for step in range(steps):
        tokens = 4096 + rng.choice([-256, 0, 128, 256, 512])  # variable sequence length
        act = tokens * hidden * 2
        saved: list[list[int]] = []
        x = b.alloc(act)
        for _ in range(layers):
            layer = [b.alloc(tokens * 4)]  # layer norm statistics
            layer.append(b.alloc(act))  # normalised input
            qkv = b.alloc(3 * act)
            layer.append(qkv)
            scores = b.alloc(tokens * 16 * 4)  # softmax stats (flash attention keeps only these)
            layer.append(scores)
            attn = b.alloc(act)
            layer.append(attn)
            proj = b.alloc(act)
            b.free(x)
            x = proj
            up = b.alloc(4 * act)
            layer.append(up)
            gelu = b.alloc(4 * act)
            layer.append(gelu)
            down = b.alloc(act)
            layer.append(b.alloc(tokens * hidden))  # dropout mask, 1 byte
            x = down
            saved.append(layer)
        loss_tmp = b.alloc(tokens * 32000 * 2)  # logits
        b.free(loss_tmp)
        grad = b.alloc(act)
        b.free(x)
        for layer in reversed(saved):
            if step == 0:
                for shape in ((hidden, 3 * hidden), (hidden, hidden), (hidden, 4 * hidden), (4 * hidden, hidden)):
                    grads.append(b.alloc(shape[0] * shape[1] * 2))
            tmp = b.alloc(4 * act)
            tmp2 = b.alloc(4 * act)
            b.free(tmp)
            new_grad = b.alloc(act)
            b.free(tmp2)
            ws = b.alloc(rng.choice([1, 4, 8, 32]) * MiB)  # a workspace
            b.free(ws)
            for key in layer:
                b.free(key)
            b.free(grad)
            grad = new_grad
        b.free(grad)
        # optimizer step: small temporaries per parameter
        for _ in range(layers * 2):
            t = b.alloc(hidden * hidden * 2)
            b.free(t)
    return b.events


def small_tensor_trace(n: int = 20_000, seed: int = 1) -> list[Event]:
    rng = random.Random(seed)
    b = _Builder()
    live: list[int] = []
    while len(b.events) < n:
        if live and (rng.random() < 0.48 or len(live) > 3000):
            # mostly LIFO, sometimes random
            idx = len(live) - 1 if rng.random() < 0.7 else rng.randrange(len(live))
            live[idx], live[-1] = live[-1], live[idx]
            b.free(live.pop())
        else:
            live.append(b.alloc(rng.choice([rng.randint(1, 4096), rng.randint(4096, 1 << 20)])))
    return b.events


def fragmentation_trace(
    n: int = 20_000, seed: int = 1234, max_live: int = 250, max_size: int = 160 * MiB, streams: int = 1
) -> list[Event]:
    """Random sizes (log-uniform from 512 B) freed in random order."""
    rng = random.Random(seed)
    b = _Builder()
    live: list[int] = []
    lo, hi = 9.0, float(max_size.bit_length())
    while len(b.events) < n:
        if live and (rng.random() < 0.5 or len(live) >= max_live):
            idx = rng.randrange(len(live))
            live[idx], live[-1] = live[-1], live[idx]
            b.free(live.pop())
        else:
            size = int(2 ** rng.uniform(lo, hi))
            live.append(b.alloc(size, stream=rng.randrange(streams)))
    return b.events


def capped_trace(seed: int = 7) -> list[Event]:
    """Large random tensors (peak ~1.7 GiB live), to be run under a cap of about 2 GiB."""
    return fragmentation_trace(n=3000, seed=seed, max_live=24, max_size=256 * MiB)


def builtin_traces() -> dict[str, dict[str, Any]]:
    traces: dict[str, dict[str, Any]] = {name: {"events": ev} for name, ev in unit_traces().items()}
    traces["transformer"] = {"events": transformer_trace()}
    traces["small_tensors"] = {"events": small_tensor_trace()}
    traces["fragmentation"] = {"events": fragmentation_trace()}
    traces["two_streams"] = {"events": fragmentation_trace(n=10_000, seed=99, streams=2)}
    ev = capped_trace()
    traces["capped_2gib"] = {"events": ev, "cap_bytes": 2 * GiB}  # the default config OOMs here
    traces["capped_2.25gib"] = {"events": ev, "cap_bytes": 9 * GiB // 4}  # releases cached segments
    return traces


def load_trace(path: str) -> dict[str, Any]:
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict):
        return {"events": [tuple(e) for e in data["events"]], "cap_bytes": data.get("cap_bytes")}
    return {"events": [tuple(e) for e in data]}


# -- the GPU side (runs in a subprocess) ----------------------------------------------------------
def _worker(traces_path: str, out_path: str) -> None:
    import torch

    traces = json.loads(Path(traces_path).read_text())
    total = torch.cuda.get_device_properties(0).total_memory
    streams: dict[int, Any] = {}
    results: dict[str, Any] = {}
    for name, spec in traces.items():
        events = spec["events"]
        cap = spec.get("cap_bytes")
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.reset_accumulated_memory_stats()
        allowed = None
        if cap is not None:
            fraction = cap / total
            torch.cuda.set_per_process_memory_fraction(fraction)
            allowed = int(fraction * float(total))  # what the allocator computes
        reserved_at_start = torch.cuda.memory_reserved()
        detail = len(events) <= DETAIL_LIMIT
        # the allocator's own trace gives the segment addresses the CUDA driver chose (see _oracle_check)
        history = detail and "expandable_segments:True" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        if history:
            torch.cuda.memory._record_memory_history(max_entries=4 * len(events) + 1000, context=None)
        timeline: list[int] = []
        tensors: dict[int, Any] = {}
        oom_index = None
        t0 = time.perf_counter()
        for i, ev in enumerate(events):
            kind, key, size = ev[0], ev[1], ev[2]
            stream = ev[3] if len(ev) > 3 else 0
            try:
                if kind > 0:
                    if stream:
                        s = streams.get(stream)
                        if s is None:
                            s = streams[stream] = torch.cuda.Stream()
                        with torch.cuda.stream(s):
                            tensors[key] = torch.empty(size, dtype=torch.uint8, device="cuda")
                    else:
                        tensors[key] = torch.empty(size, dtype=torch.uint8, device="cuda")
                else:
                    del tensors[key]
            except torch.OutOfMemoryError:
                oom_index = i
                break
            if detail:
                timeline.append(torch.cuda.memory_reserved())
        elapsed = time.perf_counter() - t0
        segment_addrs = block_addrs = None
        if history:
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            trace = snapshot["device_traces"][0]
            segment_addrs = [t["addr"] for t in trace if t["action"] == "segment_alloc"]
            block_addrs = [t["addr"] for t in trace if t["action"] == "alloc"]
        stats = torch.cuda.memory_stats()
        results[name] = {
            "max_memory_allocated": torch.cuda.max_memory_allocated(),
            "max_memory_reserved": torch.cuda.max_memory_reserved(),
            "memory_reserved_end": torch.cuda.memory_reserved(),
            "memory_allocated_end": torch.cuda.memory_allocated(),
            "reserved_at_start": reserved_at_start,
            "num_device_alloc": stats.get("num_device_alloc"),
            "num_device_free": stats.get("num_device_free"),
            "num_alloc_retries": stats.get("num_alloc_retries"),
            "num_ooms": stats.get("num_ooms"),
            "oom_index": oom_index,
            "allowed_bytes": allowed,
            "replay_seconds": elapsed,
            "timeline_reserved": timeline if detail else None,
            "segment_addrs": segment_addrs,
            "block_addrs": block_addrs,
        }
        tensors.clear()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        if cap is not None:
            torch.cuda.set_per_process_memory_fraction(1.0)
    meta = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0),
        "total_memory": total,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
    }
    Path(out_path).write_text(json.dumps({"meta": meta, "results": results}))


# -- the parent -----------------------------------------------------------------------------------
def _simulate(events: list[Event], cfg: AllocatorConfig, cap: int | None, total: int | None) -> dict[str, Any]:
    t0 = time.perf_counter()
    res = simulate_allocator(events, config=cfg, cap_bytes=cap, device_total_bytes=total)
    elapsed = time.perf_counter() - t0
    timeline = None
    if len(events) <= DETAIL_LIMIT:
        sim = CachingAllocatorSim(cfg, cap_bytes=cap, device_total_bytes=total)
        timeline = []
        for ev in events:
            try:
                if ev[0] > 0:
                    sim.malloc(ev[1], ev[2], ev[3] if len(ev) > 3 else 0)
                else:
                    sim.free(ev[1])
            except MemoryError:
                break
            timeline.append(sim.reserved_bytes)
    return {
        "peak_allocated": res.peak_allocated_bytes,
        "peak_reserved": res.peak_reserved_bytes,
        "final_reserved": res.final_reserved_bytes,
        "num_segments": res.num_segments,
        "oom_index": res.oom_event_index,
        "sim_seconds": elapsed,
        "timeline_reserved": timeline,
    }


def _oracle_check(
    events: list[Event], cfg: AllocatorConfig, cap: int | None, segment_addrs: list[int], block_addrs: list[int]
) -> int | None:
    """Replay with the GPU's own cudaMalloc addresses: index of the first alloc whose block address differs.

    The simulator only invents segment addresses; everything else (which block serves a request, where
    it is split) is decided by the allocator's rules. Given the real segment addresses, every block
    address must come out as on the GPU. None means all matched.
    """
    addrs = iter(segment_addrs)

    class _Oracle(CachingAllocatorSim):
        def _segment_address(self, size: int, small: bool) -> int:
            return next(addrs)

    sim = _Oracle(cfg, cap_bytes=cap)
    j = 0
    for i, ev in enumerate(events):
        try:
            if ev[0] > 0:
                sim.malloc(ev[1], ev[2], ev[3] if len(ev) > 3 else 0)
                block = sim._live[ev[1]]
                if block is not None:
                    if j >= len(block_addrs) or block.addr != block_addrs[j]:
                        return i
                    j += 1
            else:
                sim.free(ev[1])
        except (MemoryError, StopIteration):
            return None if j == len(block_addrs) else i
    return None if j == len(block_addrs) else len(events)


def _first_divergence(a: list[int] | None, b: list[int] | None) -> int | None:
    if a is None or b is None:
        return None
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="*", help="JSON trace files to replay besides the built-in ones")
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--extra-configs", action="store_true", help="also max_split_size_mb, roundup, gc configs")
    parser.add_argument("--only", default=None, help="comma-separated trace names to run")
    parser.add_argument("--worker", nargs=2, metavar=("TRACES_JSON", "OUT_JSON"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        _worker(*args.worker)
        return 0

    import torch

    if not torch.cuda.is_available():
        print(
            "allocator_replay_gpu: no CUDA device is available (torch.cuda.is_available() is False); "
            "run this script on a machine with an NVIDIA GPU.",
            file=sys.stderr,
        )
        return 2
    total = torch.cuda.get_device_properties(0).total_memory

    traces = builtin_traces()
    for path in args.traces:
        traces[Path(path).stem] = load_trace(path)
    if args.only:
        wanted = set(args.only.split(","))
        traces = {k: v for k, v in traces.items() if k in wanted}
    configs = dict(CONFIGS)
    if args.extra_configs:
        configs.update(EXTRA_CONFIGS)

    t_start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    meta: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        traces_path = Path(tmp) / "traces.json"
        traces_path.write_text(json.dumps(traces))
        for cname, cfg in configs.items():
            out_path = Path(tmp) / f"gpu_{cname}.json"
            env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=cfg.to_alloc_conf())
            env.pop("PYTORCH_ALLOC_CONF", None)
            proc = subprocess.run(
                [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--out",
                    "-",
                    "--worker",
                    str(traces_path),
                    str(out_path),
                ],
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            if proc.returncode != 0:
                print(f"[{cname}] worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}", file=sys.stderr)
                continue
            gpu = json.loads(out_path.read_text())
            meta = gpu["meta"]
            for tname, spec in traces.items():
                real = gpu["results"][tname]
                cap = real["allowed_bytes"]
                sim = _simulate([tuple(e) for e in spec["events"]], cfg, cap, total)
                div = _first_divergence(real.pop("timeline_reserved"), sim.pop("timeline_reserved"))
                seg_addrs, blk_addrs = real.pop("segment_addrs"), real.pop("block_addrs")
                oracle = "-"
                if seg_addrs is not None and blk_addrs is not None:
                    bad = _oracle_check([tuple(e) for e in spec["events"]], cfg, cap, seg_addrs, blk_addrs)
                    oracle = "ok" if bad is None else bad
                rows.append(
                    {
                        "trace": tname,
                        "config": cname,
                        "alloc_conf": cfg.to_alloc_conf(),
                        "events": len(spec["events"]),
                        "cap_bytes": cap,
                        "real": real,
                        "sim": sim,
                        "reserved_match": real["max_memory_reserved"] == sim["peak_reserved"],
                        "allocated_match": real["max_memory_allocated"] == sim["peak_allocated"],
                        "oom_match": real["oom_index"] == sim["oom_index"],
                        "first_reserved_divergence": div,
                        "oracle_first_block_mismatch": oracle,
                    }
                )
    wall = time.perf_counter() - t_start
    Path(args.out).write_text(json.dumps({"meta": meta, "wall_seconds": wall, "rows": rows}, indent=1))

    print(f"torch {meta.get('torch')} on {meta.get('device')}; {len(rows)} runs in {wall:.1f} s")
    header = (
        f"{'trace':<22} {'config':<26} {'events':>6} {'real alloc':>10} {'sim alloc':>10} "
        f"{'real resv':>10} {'sim resv':>10} {'diff':>8} {'oom r/s':>11} {'diverge':>7} {'oracle':>6}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        real, sim = r["real"], r["sim"]
        diff = (sim["peak_reserved"] - real["max_memory_reserved"]) / MiB
        print(
            f"{r['trace']:<22} {r['config']:<26} {r['events']:>6} {real['max_memory_allocated'] / MiB:>10.1f} "
            f"{sim['peak_allocated'] / MiB:>10.1f} {real['max_memory_reserved'] / MiB:>10.1f} "
            f"{sim['peak_reserved'] / MiB:>10.1f} {diff:>+8.1f} "
            f"{str(real['oom_index']) + '/' + str(sim['oom_index']):>11} "
            f"{'-' if r['first_reserved_divergence'] is None else r['first_reserved_divergence']:>7} "
            f"{r['oracle_first_block_mismatch']!s:>6}"
        )
    n_ok = sum(r["reserved_match"] and r["allocated_match"] and r["oom_match"] for r in rows)
    print(f"exact matches (peak allocated, peak reserved, OOM point): {n_ok}/{len(rows)}  (sizes in MiB)")
    print(
        "diverge: first event after which memory_reserved differed ('-': never); oracle: replay with the GPU's "
        "own segment addresses, 'ok' when every block address matched"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
