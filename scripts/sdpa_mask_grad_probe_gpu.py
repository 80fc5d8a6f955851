#!/usr/bin/env python
"""Attention with a learned additive mask (Swin's relative-position bias, T5's position bias): which CUDA kernel
runs, what it keeps for backward and what its backward allocates, beside memopt's CPU emulation of the same call.

Each case calls ``scaled_dot_product_attention`` under bf16 autocast on fp32 leaves, as a model's attention does
(q, k, v and the mask are cast by autocast, the mask derived from a parameter so it requires grad). On a GPU the
row holds the backend CUDA chose (``torch._fused_sdp_choice`` on the cast inputs), the bytes retained after the
forward, the backward's peak and what stays after it; with ``--emulated`` (any machine) the same call runs on CPU
fake tensors under ``memopt.profile.cuda_semantics`` with memopt's tracker counting the bytes.

    python scripts/sdpa_mask_grad_probe_gpu.py --out $OUT/sdpa_mask_grad.json            # on the GPU
    python scripts/sdpa_mask_grad_probe_gpu.py --emulated --out /tmp/sdpa_emulated.json  # memopt's figures
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

# (name, batch, heads, length, head dim, mask: "bias" (1, H, L, L) learned, "bias+window" learned bias plus a
# per-window constant mask (B, 1, L, L), "full" a learned (B, H, L, L), "const" a constant (B, 1, L, L), dropout)
CASES: list[tuple[str, int, int, int, int, str, float]] = [
    ("swin_s0_bias", 4096, 4, 49, 32, "bias", 0.0),
    ("swin_s0_bias+window", 4096, 4, 49, 32, "bias+window", 0.0),
    ("swin_s2_bias+window", 256, 16, 49, 32, "bias+window", 0.0),
    ("aligned_bias", 1024, 8, 64, 64, "bias", 0.0),
    ("t5_bias", 16, 12, 512, 64, "bias", 0.0),
    ("t5_bias_odd", 16, 12, 500, 64, "bias", 0.0),
    ("t5_bias_dropout", 16, 12, 512, 64, "bias", 0.1),
    ("t5_full_dropout", 16, 12, 512, 64, "full", 0.1),
    ("swin_s0_bias_dropout", 4096, 4, 49, 32, "bias", 0.1),
    ("full_grad", 16, 8, 256, 64, "full", 0.0),
    ("const_window", 4096, 4, 49, 32, "const", 0.0),
    ("const_dropout", 16, 12, 512, 64, "const", 0.1),
]


def _inputs(b: int, h: int, length: int, d: int, device: str) -> tuple[Any, ...]:
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device)

    q, k, v = (rnd(b, length, h, d).transpose(1, 2).requires_grad_() for _ in range(3))
    table = rnd(1, h, length, length).requires_grad_()
    return q, k, v, table


def _mask(table: torch.Tensor, b: int, h: int, length: int, kind: str) -> torch.Tensor:
    bias = table * 1.0  # a non-leaf derived from a parameter, as Swin's gathered table is
    if kind == "bias":
        return bias
    window = torch.zeros(b, 1, length, length, device=table.device)
    if kind == "bias+window":
        return bias + window
    if kind == "const":
        return window
    return bias.expand(b, h, length, length) * 1.0


def _choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, p: float) -> str:
    names = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}
    try:
        return names.get(int(torch._fused_sdp_choice(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask.bfloat16(),
                                                     p, False)), "?")
    except Exception as exc:
        return f"error: {exc}"[:200]


def run_gpu() -> list[dict[str, Any]]:
    rows = []
    for name, b, h, length, d, kind, p in CASES:
        q, k, v, table = _inputs(b, h, length, d, "cuda")
        row: dict[str, Any] = {"case": name, "shape": [b, h, length, d], "mask": kind, "dropout": p}
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            mask = _mask(table, b, h, length, kind)
            row["choice"] = _choice(q, k, v, mask, p)
            torch.cuda.synchronize()
            mask_bytes = torch.cuda.memory_allocated() - base
            torch.cuda.reset_peak_memory_stats()
            out = F.scaled_dot_product_attention(q, k, v, mask, dropout_p=p)
        torch.cuda.synchronize()
        row["mask_bytes"] = mask_bytes
        row["fwd_retained_bytes"] = torch.cuda.memory_allocated() - base
        row["fwd_peak_bytes"] = torch.cuda.max_memory_allocated() - base
        row["saved"] = [type(out.grad_fn).__name__]
        base2 = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python")
        out.transpose(1, 2).float().sum().backward()  # the gradient in the output's layout, as a model's
        torch.cuda.synchronize()
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
        torch.cuda.memory._record_memory_history(enabled=None)
        row["bwd_events"] = [(e["action"][0], e["size"]) for e in trace if e["action"] in ("alloc", "free_completed")]
        row["bwd_peak_bytes"] = torch.cuda.max_memory_allocated() - base2
        del out, mask
        row["after_bwd_bytes"] = torch.cuda.memory_allocated() - base
        rows.append(row)
        del q, k, v, table
        torch.cuda.empty_cache()
    return rows


def run_emulated() -> list[dict[str, Any]]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memopt.plan.context import resolve_hardware
    from memopt.profile.cuda_semantics import cuda_semantics, kernel_policy_for
    from memopt.profile.tracker import MemoryTracker

    policy = kernel_policy_for(resolve_hardware("h200"))
    rows = []
    for name, b, h, length, d, kind, p in CASES:
        row: dict[str, Any] = {"case": name, "shape": [b, h, length, d], "mask": kind, "dropout": p}
        log: list[str] = []
        with FakeTensorMode(), contextlib.ExitStack() as stack:
            q, k, v, table = _inputs(b, h, length, d, "cpu")
            stack.enter_context(cuda_semantics(policy, None, log))
            t = stack.enter_context(MemoryTracker("cpu"))
            for x in (q, k, v, table):
                t.track(x)
            base = t.current_bytes
            with torch.autocast("cpu", dtype=torch.bfloat16):
                mask = _mask(table, b, h, length, kind)
                mask_bytes = t.current_bytes - base
                t.reset_peak()
                out = F.scaled_dot_product_attention(q, k, v, mask, dropout_p=p)
            row["choice"] = log[-1] if log else "?"
            row["mask_bytes"] = mask_bytes
            row["fwd_retained_bytes"] = t.current_bytes - base
            row["fwd_peak_bytes"] = t.peak_bytes - base
            base2 = t.current_bytes
            t.reset_peak()
            out.transpose(1, 2).float().sum().backward()  # the gradient in the output's layout, as a model's
            row["bwd_peak_bytes"] = t.peak_bytes - base2
            del out, mask
            row["after_bwd_bytes"] = t.current_bytes - base
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--emulated", action="store_true", help="memopt's CPU emulation instead of the GPU")
    args = parser.parse_args(argv)
    rows = run_emulated() if args.emulated else run_gpu()
    meta = {"torch": torch.__version__,
            "device": "emulated h200" if args.emulated else torch.cuda.get_device_name()}
    Path(args.out).write_text(json.dumps({**meta, "rows": rows}, indent=1))
    for r in rows:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
