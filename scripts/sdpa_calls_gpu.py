#!/usr/bin/env python
"""Which attention kernel each ``scaled_dot_product_attention`` call of a zoo model runs on this GPU, with the
inputs that decided it (shapes, strides, dtypes, whether the mask needs a gradient): one forward and backward
of a ``zoo_matrix_gpu.py`` row under bf16 autocast.

    python scripts/sdpa_calls_gpu.py t5v11base-16x512-12GiB swinbase-64x224-16GiB --out $OUT/sdpa_calls.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import zoo_matrix_gpu as zoo


def _desc(t: object) -> object:
    if isinstance(t, torch.Tensor):
        return {"shape": list(t.shape), "stride": list(t.stride()), "dtype": str(t.dtype).removeprefix("torch."),
                "grad": t.requires_grad}
    return t if isinstance(t, (int, float, bool, type(None))) else str(t)


class SdpaLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if "attention" in name or "softmax" in name:
            self.calls[json.dumps({"op": name, "args": [_desc(a) for a in args[:4]]})] += 1
        return func(*args, **(kwargs or {}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", nargs="+")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = {}
    for row_id in args.rows:
        row = next(r for r in zoo.ROWS if r.id == row_id)
        model = zoo.build(row).cuda().train()
        batch = {k: v.cuda() for k, v in zoo.batch_for(row, model).items()}
        # the mask's requires_grad as the SDPA call sees it, before dispatch strips autograd
        seen: Counter[str] = Counter()
        original = torch.nn.functional.scaled_dot_product_attention

        def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
            seen[json.dumps({"q": _desc(q), "mask": _desc(attn_mask), "dropout": dropout_p, "causal": is_causal,
                             "choice": int(torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal))})] += 1
            return original(q, k, v, attn_mask, dropout_p, is_causal, **kw)

        torch.nn.functional.scaled_dot_product_attention = spy
        log = SdpaLog()
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16), log:
                loss = model(**batch).loss
            loss.backward()
        finally:
            torch.nn.functional.scaled_dot_product_attention = original
        result[row_id] = {"sdpa_calls": [{"count": n, **json.loads(k)} for k, n in seen.items()],
                          "dispatched": [{"count": n, **json.loads(k)} for k, n in log.calls.items()]}
        print(row_id, json.dumps(result[row_id], indent=None)[:3000], flush=True)
        del model, batch, loss
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
