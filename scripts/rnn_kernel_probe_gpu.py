#!/usr/bin/env python
"""What cuDNN's recurrent kernel allocates and how long it runs, per layer shape: the facts the CPU trace needs to
count ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` as the one fused kernel the GPU runs instead of unrolling every step.

For each configuration (mode, dtype, autocast, input and hidden size, layers, directions, projection, batch,
sequence, packed or padded) one training forward and backward of the module on the GPU, recording:
``aten_ops`` (the ATen calls with their output sizes, so the reserve space and the re-flattened weight buffer are
read off ``_cudnn_rnn``'s outputs), ``forward_transient_bytes`` / ``backward_transient_bytes`` (the allocated peak
inside the call above what is alive before and after it: the kernel's workspace), ``saved_bytes`` (allocated after
the forward less before it, with the output held) and the median forward / backward time.

    python scripts/rnn_kernel_probe_gpu.py --out $OUT/rnn_kernel.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


class OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[dict[str, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        self.ops.append({"op": func.name(), "outputs": [
            {"shape": list(o.shape), "dtype": str(o.dtype).removeprefix("torch."),
             "bytes": o.untyped_storage().nbytes()}
            for o in outs if isinstance(o, torch.Tensor)]})
        return out


def _module(mode: str, i: int, h: int, layers: int, bidir: bool, proj: int) -> nn.Module:
    kw = dict(num_layers=layers, bidirectional=bidir, batch_first=True)
    if mode == "lstm":
        return nn.LSTM(i, h, proj_size=proj, **kw)
    if mode == "gru":
        return nn.GRU(i, h, **kw)
    return nn.RNN(i, h, nonlinearity="tanh", **kw)


def probe(cfg: dict[str, Any], repeats: int) -> dict[str, Any]:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    m = _module(cfg["mode"], cfg["input"], cfg["hidden"], cfg["layers"], cfg["bidir"], cfg["proj"]).cuda()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg["dtype"]]
    if not cfg["autocast"]:
        m = m.to(dtype)
    x = torch.randn(cfg["batch"], cfg["seq"], cfg["input"], device="cuda",
                    dtype=torch.float32 if cfg["autocast"] else dtype, requires_grad=True)
    lengths = None
    if cfg["packed"]:
        lengths = torch.linspace(cfg["seq"], max(1, cfg["seq"] // 4), cfg["batch"]).long()

    def forward() -> torch.Tensor:
        with torch.autocast("cuda", dtype=dtype, enabled=cfg["autocast"]):
            inp = x
            if lengths is not None:
                inp = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=True)
            out, _ = m(inp)
            return out.data if lengths is not None else out

    for _ in range(2):  # warm up cuDNN's plans
        forward().float().sum().backward()
    m.zero_grad(set_to_none=True)
    x.grad = None
    torch.cuda.synchronize()
    log = OpLog()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with log:
        out = forward()
    torch.cuda.synchronize()
    after_fwd = torch.cuda.memory_allocated()
    fwd_peak = torch.cuda.max_memory_allocated()
    out_bytes = out.untyped_storage().nbytes()
    grad = torch.ones_like(out)
    torch.cuda.synchronize()
    before_bwd = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with log:
        out.backward(grad)
    torch.cuda.synchronize()
    bwd_peak = torch.cuda.max_memory_allocated()
    after_bwd = torch.cuda.memory_allocated()
    del out, grad
    fwd_times, bwd_times = [], []
    for _ in range(repeats):
        m.zero_grad(set_to_none=True)
        x.grad = None
        e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        e0.record()
        o = forward()
        e1.record()
        o.backward(torch.ones_like(o))
        e2.record()
        torch.cuda.synchronize()
        fwd_times.append(e0.elapsed_time(e1) / 1e3)
        bwd_times.append(e1.elapsed_time(e2) / 1e3)
        del o
    return {**cfg, "aten_ops": [o for o in log.ops if "rnn" in o["op"] or "flatten" in o["op"]
                                or "_cudnn" in o["op"]],
            "all_ops": sorted({o["op"] for o in log.ops}),
            "param_bytes": sum(p.numel() * p.element_size() for p in m.parameters()),
            "output_bytes": out_bytes,
            "saved_bytes": after_fwd - base,
            "forward_transient_bytes": fwd_peak - after_fwd,
            "backward_transient_bytes": bwd_peak - max(before_bwd, after_bwd),
            "backward_peak_above_start_bytes": bwd_peak - before_bwd,
            "after_backward_above_start_bytes": after_bwd - base,
            "forward_s": statistics.median(fwd_times), "backward_s": statistics.median(bwd_times)}


def configs() -> list[dict[str, Any]]:
    base = dict(mode="gru", dtype="fp32", autocast=False, input=512, hidden=512, layers=1, bidir=False, proj=0,
                batch=16, seq=128, packed=False)
    out = []
    for mode, dtype, autocast in itertools.product(("lstm", "gru", "rnn"), ("fp32", "bf16"), (False, True)):
        if dtype == "fp32" and autocast:
            continue
        out.append({**base, "mode": mode, "dtype": dtype, "autocast": autocast})
    for mode in ("lstm", "gru"):  # each size axis alone, fp32 and bf16 autocast
        for dtype, autocast in (("fp32", False), ("bf16", True)):
            c = {**base, "mode": mode, "dtype": dtype, "autocast": autocast}
            for k, vals in (("hidden", (256, 1024, 1536, 2048)), ("input", (128, 2048)), ("layers", (2, 3)),
                            ("batch", (1, 8, 32, 64)), ("seq", (16, 64, 512, 1024)), ("bidir", (True,)),
                            ("packed", (True,))):
                out.extend({**c, k: v} for v in vals)
    out.append({**base, "mode": "lstm", "proj": 256, "hidden": 1024})
    out.append({**base, "mode": "lstm", "proj": 256, "hidden": 1024, "dtype": "bf16", "autocast": True})
    # the zoo's GRU rows
    out.append({**base, "input": 1536, "hidden": 1536, "layers": 3, "batch": 16, "seq": 512})
    out.append({**base, "input": 2048, "hidden": 2048, "layers": 2, "batch": 8, "seq": 1024})
    out.append({**base, "mode": "lstm", "input": 1024, "hidden": 1024, "layers": 2, "batch": 32, "seq": 256,
                "bidir": True})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = False
    rows = []
    for cfg in configs():
        try:
            rows.append(probe(cfg, args.repeats))
        except Exception as e:  # a configuration cuDNN refuses is a fact too
            rows.append({**cfg, "error": f"{type(e).__name__}: {e}"[:300]})
        print(json.dumps({k: rows[-1].get(k) for k in ("mode", "dtype", "autocast", "hidden", "layers", "batch",
                                                         "seq", "saved_bytes", "forward_s", "error")}), flush=True)
    meta = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
            "device": torch.cuda.get_device_name(0)}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
