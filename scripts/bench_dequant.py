#!/usr/bin/env python
"""Time bitsandbytes' 4-bit linear against a bf16 linear on the GPU, per weight shape (the time model's dequantization
term). Frozen weights, as under LoRA: forward, and backward to the input only.

    python scripts/bench_dequant.py --out OUT/dequant.json [--tokens 2048] [--shapes llama3_8b]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

SHAPES = {"llama3_8b": [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]}


def _time(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / repeats


def bench(shapes: list[tuple[int, int]], tokens: int) -> list[dict]:
    import bitsandbytes as bnb

    from memopt.techniques.quantization import QuantSetting
    from memopt.techniques.quantization_apply import quantize_linear

    rows = []
    for out_f, in_f in shapes:
        lin = torch.nn.Linear(in_f, out_f, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
        q = quantize_linear(lin, QuantSetting(), device="cuda")
        x = torch.randn(tokens, in_f, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(tokens, out_f, device="cuda", dtype=torch.bfloat16)

        def fwd_bwd(layer):
            def run():
                y = layer(x)
                y.backward(g)
            return run

        def dequant():
            bnb.functional.dequantize_4bit(q.weight.data, q.weight.quant_state)

        row = {"out_features": out_f, "in_features": in_f, "tokens": tokens,
               "bf16_fwd_bwd_s": _time(fwd_bwd(lin)), "nf4_fwd_bwd_s": _time(fwd_bwd(q)),
               "dequantize_4bit_s": _time(dequant)}
        n = out_f * in_f
        row["dequant_bytes"] = n // 2 + n * 2
        row["dequant_effective_bandwidth"] = row["dequant_bytes"] / row["dequantize_4bit_s"]
        rows.append(row)
        print(json.dumps(row))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--shapes", default="llama3_8b")
    args = ap.parse_args()
    rows = bench(SHAPES[args.shapes], args.tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
