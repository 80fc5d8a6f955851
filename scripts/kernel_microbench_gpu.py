#!/usr/bin/env python
"""GPU times of the op classes the clock misses on (``benchmarks/plan_quality/h100_s39``), each beside the bytes it
moves, and the host-speed probe (``memopt.host_speed``) repeated:

    python scripts/kernel_microbench_gpu.py --out $OUT/microbench.json

* BatchNorm2d in training, bf16 autocast on channels-first input (PyTorch's own kernels: cuDNN is not used for
  bf16), and channels-last, over channel counts and spatial sizes: forward and forward + backward;
* 3x3 convolutions in bf16, channels-first against channels-last (cuDNN converts channels-first tensors around
  its kernels);
* ``gather`` backward (a scatter-add) with DeBERTa-like relative-position indices against a copy of the same bytes;
* an elementwise add, for the achieved memory bandwidth.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _time(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def batch_norm_rows() -> list[dict]:
    rows = []
    for c, hw in [(64, 112), (64, 56), (128, 56), (256, 56), (128, 28), (512, 28), (256, 14), (1024, 14),
                  (512, 7), (2048, 7)]:
        for layout in ("nchw", "nhwc"):
            x = torch.randn(96, c, hw, hw, device="cuda", dtype=torch.bfloat16)
            if layout == "nhwc":
                x = x.contiguous(memory_format=torch.channels_last)
            x.requires_grad_(True)
            bn = torch.nn.BatchNorm2d(c).cuda()
            g = torch.randn_like(x)

            def fwd() -> None:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    bn(x)

            def fwd_bwd() -> None:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    y = bn(x)
                y.backward(g)

            rows.append({"op": "batch_norm", "layout": layout, "channels": c, "hw": hw, "batch": 96,
                         "tensor_bytes": x.numel() * 2, "forward_s": _time(fwd), "forward_backward_s": _time(fwd_bwd)})
    return rows


def conv_rows() -> list[dict]:
    rows = []
    for c, hw in [(64, 56), (128, 28), (256, 14), (512, 7)]:
        for layout in ("nchw", "nhwc"):
            x = torch.randn(96, c, hw, hw, device="cuda", dtype=torch.bfloat16)
            conv = torch.nn.Conv2d(c, c, 3, padding=1, bias=False).cuda().to(torch.bfloat16)
            if layout == "nhwc":
                x = x.contiguous(memory_format=torch.channels_last)
                conv = conv.to(memory_format=torch.channels_last)
            x.requires_grad_(True)
            g = torch.randn_like(conv(x))

            def fwd_bwd() -> None:
                conv(x).backward(g)

            rows.append({"op": "conv3x3", "layout": layout, "channels": c, "hw": hw, "batch": 96,
                         "tensor_bytes": x.numel() * 2, "flops_fwd": 2 * 96 * c * c * 9 * hw * hw,
                         "forward_s": _time(lambda: conv(x)), "forward_backward_s": _time(fwd_bwd)})
    return rows


def gather_rows() -> list[dict]:
    rows = []
    for b, h, length, span in [(32, 12, 512, 256), (16, 16, 1024, 256), (32, 12, 512, 64)]:
        src = torch.randn(b, h, length, 2 * span, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        rel = torch.arange(length, device="cuda")[:, None] - torch.arange(length, device="cuda")[None, :]
        index = (rel.clamp(-span, span - 1) + span).expand(b, h, length, length).contiguous()
        out = torch.gather(src, -1, index)
        g = torch.randn_like(out)

        def bwd() -> None:
            torch.autograd.grad(torch.gather(src, -1, index), src, g)

        copy_src = torch.empty_like(out)
        rows.append({"op": "gather_backward", "batch": b, "heads": h, "length": length, "span": span,
                     "out_bytes": out.numel() * 2, "index_bytes": index.numel() * 8, "src_bytes": src.numel() * 2,
                     "forward_backward_s": _time(bwd), "copy_out_s": _time(lambda: copy_src.copy_(out))})
    return rows


def bandwidth_row() -> dict:
    a = torch.randn(256 * 2**20, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    s = _time(lambda: torch.add(a, b))
    return {"op": "add", "bytes": 3 * a.numel() * 2, "s": s, "achieved_bytes_per_s": 3 * a.numel() * 2 / s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from memopt.host_speed import probe_op_seconds

    started = time.time()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "probe_op_s": [probe_op_seconds() for _ in range(5)], "bandwidth": bandwidth_row(),
              "batch_norm": batch_norm_rows(), "conv": conv_rows(), "gather": gather_rows()}
    result["probe_op_s_after"] = [probe_op_seconds() for _ in range(3)]
    result["wall_s"] = time.time() - started
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("batch_norm", "conv", "gather")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
