#!/usr/bin/env python
"""The fused recurrent kernel's emulation (``memopt.profile.recurrent_kernels``) against what cuDNN did on the GPU
(``scripts/rnn_kernel_probe_gpu.py``'s rows), configuration by configuration: the reserve space, the bytes the
forward leaves alive, the transient peaks of the forward and the backward, and the GPU time of one forward and
backward against the time model's terms. Runs on the CPU.

    python scripts/rnn_kernel_fit.py benchmarks/recurrent/rnn_kernel_h200.json --out benchmarks/recurrent/fit
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import memopt
from memopt.estimate.timing import DEFAULT_TIMING, segment_terms, terms_time
from memopt.profile.costs import CostRecorder
from memopt.profile.cuda_semantics import cuda_semantics, kernel_policy_for
from memopt.profile.tracker import MemoryTracker

HW = memopt.load_hardware("h200")
POLICY = kernel_policy_for(HW)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _module(cfg: dict[str, Any]) -> nn.Module:
    kw = dict(num_layers=cfg["layers"], bidirectional=cfg["bidir"], batch_first=True)
    if cfg["mode"] == "lstm":
        return nn.LSTM(cfg["input"], cfg["hidden"], proj_size=cfg["proj"], **kw)
    if cfg["mode"] == "gru":
        return nn.GRU(cfg["input"], cfg["hidden"], **kw)
    return nn.RNN(cfg["input"], cfg["hidden"], **kw)


def emulate(cfg: dict[str, Any]) -> dict[str, Any]:
    """The probe's measurements, taken on the emulation: fake tensors under the CUDA semantics."""
    dtype = DTYPES[cfg["dtype"]]
    module = _module(cfg)
    if not cfg["autocast"]:
        module = module.to(dtype)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        for name, p in list(module.named_parameters()):
            setattr(module, name, nn.Parameter(fake.from_tensor(p.detach())))
        x = torch.empty(cfg["batch"], cfg["seq"], cfg["input"], dtype=torch.float32 if cfg["autocast"] else dtype,
                        requires_grad=True)
        lengths = torch.linspace(cfg["seq"], max(1, cfg["seq"] // 4), cfg["batch"]).long() if cfg["packed"] else None
        tracker = MemoryTracker("cpu")
        phase = [0]
        costs = CostRecorder(lambda: phase[0])
        tracker.op_hooks.append(costs)
        with cuda_semantics(POLICY, tracker), tracker:
            base = tracker.current_bytes
            tracker.reset_peak()
            with torch.autocast("cpu", dtype=dtype, enabled=cfg["autocast"]):
                inp = x
                if lengths is not None:
                    inp = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True)
                out, _ = module(inp)
                out = out.data if lengths is not None else out
            after_fwd = tracker.current_bytes
            fwd_peak = tracker.peak_bytes
            grad = torch.ones_like(out)
            before_bwd = tracker.current_bytes
            tracker.reset_peak()
            phase[0] = 1
            out.backward(grad)
            bwd_peak = tracker.peak_bytes
            after_bwd = tracker.current_bytes
    fwd_t = terms_time(segment_terms(costs.costs[0], costs.costs[0], 1, HW))
    bwd_t = terms_time(segment_terms(costs.costs[1], costs.costs[1], 1, HW))
    return {"saved_bytes": after_fwd - base, "forward_transient_bytes": fwd_peak - after_fwd,
            "backward_transient_bytes": bwd_peak - max(before_bwd, after_bwd),
            "forward_s": fwd_t, "backward_s": bwd_t,
            "library_kernels": costs.costs[0].library_kernels + costs.costs[1].library_kernels}


def _reserve(row: dict[str, Any]) -> int | None:
    for op in row.get("aten_ops", []):
        if op["op"] == "aten::_cudnn_rnn":
            return op["outputs"][3]["bytes"]
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("probe")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    data = json.loads(Path(args.probe).read_text())
    rows = []
    for r in data["rows"]:
        if "error" in r:
            continue
        e = emulate(r)
        rows.append({"config": {k: r[k] for k in ("mode", "dtype", "autocast", "input", "hidden", "layers", "bidir",
                                                   "proj", "batch", "seq", "packed")},
                     "measured_reserve_bytes": _reserve(r),
                     **{f"measured_{k}": r[k] for k in ("saved_bytes", "forward_transient_bytes",
                                                         "backward_transient_bytes", "forward_s", "backward_s")},
                     **{f"emulated_{k}": v for k, v in e.items()}})
    lines = ["| mode | dtype | ac | I | H | L | bi | proj | B | T | packed | saved meas | saved emu | err "
             "| fwd tmp meas/emu | bwd tmp meas/emu | time meas | time emu | err |", "|" + "---|" * 19]
    errs_saved, errs_time = [], []
    for r in rows:
        c = r["config"]
        sm, se = r["measured_saved_bytes"], r["emulated_saved_bytes"]
        mib = {k: r[k] / 2**20 for k in ("measured_forward_transient_bytes", "emulated_forward_transient_bytes",
                                           "measured_backward_transient_bytes", "emulated_backward_transient_bytes")}
        tm = r["measured_forward_s"] + r["measured_backward_s"]
        te = r["emulated_forward_s"] + r["emulated_backward_s"]
        es, et = se / sm - 1 if sm else 0.0, te / tm - 1
        errs_saved.append(abs(es))
        errs_time.append(abs(et))
        lines.append(f"| {c['mode']} | {c['dtype']} | {int(c['autocast'])} | {c['input']} | {c['hidden']} "
                     f"| {c['layers']} | {int(c['bidir'])} | {c['proj']} | {c['batch']} | {c['seq']} "
                     f"| {int(c['packed'])} | {sm / 2**20:.2f} MiB | {se / 2**20:.2f} MiB | {100 * es:+.1f}% "
                     f"| {mib['measured_forward_transient_bytes']:.1f}/{mib['emulated_forward_transient_bytes']:.1f} "
                     f"| {mib['measured_backward_transient_bytes']:.1f}/{mib['emulated_backward_transient_bytes']:.1f} "
                     f"| {1e3 * tm:.2f} ms | {1e3 * te:.2f} ms | {100 * et:+.0f}% |")
    summary = {"rows": len(rows), "saved_error_median": statistics.median(errs_saved),
               "saved_error_max": max(errs_saved), "time_error_median": statistics.median(errs_time),
               "time_error_max": max(errs_time), "recurrent_step_s": DEFAULT_TIMING.recurrent_step_s,
               "probe_meta": data.get("meta")}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    out.with_suffix(".md").write_text("\n".join(["# cuDNN's recurrent kernel: measured vs emulated\n",
                                                 json.dumps(summary), "", *lines, ""]))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
