#!/usr/bin/env python
"""Facts of a GPU software stack that the estimator needs, measured (one call, about a minute).

    python scripts/gpu_probe.py --out benchmarks/probe/h200.json [--ops-out ops.json.gz]

1. environment: torch/CUDA/cuDNN versions, device properties, SDPA priority order;
2. memory outside the allocator (CUDA context, handles) and cuBLAS workspace per thread;
3. scaled_dot_product_attention: the backend chosen for typical shapes, and per backend the bytes
   retained by forward and the transient peaks of forward and backward;
4. with --ops-out: per-op allocation logs of training steps of a few models (the allocator's own
   figures around every op), to compare op by op with memopt's CPU trace.
Each part runs in its own process so one does not disturb the next.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # is_available() must not start CUDA before fork
import torch


def _fork(fn, *args):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            out = fn(*args)
        except BaseException as exc:
            import traceback

            out = {"error": repr(exc), "traceback": traceback.format_exc()[-3000:]}
        with os.fdopen(w, "w") as f:
            f.write(json.dumps(out))
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data) if data else {"error": "no output"}


def env_and_overhead() -> dict:
    torch.cuda.init()
    total = torch.cuda.get_device_properties(0).total_memory
    props = torch.cuda.get_device_properties(0)
    out = {
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(), "device": props.name, "total_memory": total,
        "cc": [props.major, props.minor], "sms": props.multi_processor_count,
    }
    x = torch.empty(1, device="cuda")
    free, _ = torch.cuda.mem_get_info()
    out["outside_after_init"] = total - free - torch.cuda.memory_reserved()
    a = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    b = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    before = torch.cuda.memory_allocated()
    c = a @ b
    out["cublas_ws_forward"] = torch.cuda.memory_allocated() - before - c.numel() * 4
    free, _ = torch.cuda.mem_get_info()
    out["outside_after_cublas"] = total - free - torch.cuda.memory_reserved()
    before = torch.cuda.memory_allocated()
    c.sum().backward()
    grads = a.grad.numel() * 4 + b.grad.numel() * 4
    out["after_backward_extra"] = torch.cuda.memory_allocated() - before - grads
    with torch.autocast("cuda", dtype=torch.bfloat16):
        d = a @ b
    out["after_bf16_mm_extra"] = torch.cuda.memory_allocated() - before - grads - d.numel() * 2 - 2 * 1024 * 1024 * 2
    free, _ = torch.cuda.mem_get_info()
    out["outside_after_backward"] = total - free - torch.cuda.memory_reserved()
    out["sdp_priority_order"] = list(torch._C._get_sdp_priority_order())
    del x
    return out


def sdpa_facts() -> dict:
    torch.cuda.init()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    res: dict = {"choices": [], "backends": []}
    shapes = [
        ("causal_bf16", 2, 16, 16, 2048, 128, torch.bfloat16, None, 0.0, True),
        ("gqa_bf16", 2, 32, 8, 2048, 64, torch.bfloat16, None, 0.0, True),
        ("dropout_bf16", 4, 16, 16, 1024, 64, torch.bfloat16, None, 0.1, True),
        ("noncausal_bf16", 4, 16, 16, 1024, 64, torch.bfloat16, None, 0.1, False),
        ("fp32_causal", 2, 16, 16, 1024, 64, torch.float32, None, 0.0, True),
        ("bool_mask_bf16", 2, 16, 16, 1000, 64, torch.bfloat16, "bool", 0.0, False),
        ("float_mask_bf16", 2, 12, 12, 1024, 64, torch.bfloat16, "float", 0.0, False),
        ("odd_len_bf16", 2, 16, 16, 1000, 64, torch.bfloat16, None, 0.0, True),
    ]
    names = {SDPBackend.FLASH_ATTENTION: "flash", SDPBackend.EFFICIENT_ATTENTION: "efficient",
             SDPBackend.CUDNN_ATTENTION: "cudnn", SDPBackend.MATH: "math"}
    for name, b, h, hk, length, d, dtype, mask_kind, p, causal in shapes:
        def make():
            q = torch.randn(b, length, h, d, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
            k = torch.randn(b, length, hk, d, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
            v = torch.randn(b, length, hk, d, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
            mask = None
            if mask_kind == "bool":
                mask = torch.ones(b, 1, length, length, device="cuda", dtype=torch.bool).tril()
            elif mask_kind == "float":
                mask = torch.zeros(b, h, length, length, device="cuda", dtype=dtype)
            return q, k, v, mask
        q, k, v, mask = make()
        gqa = h != hk
        try:
            choice = int(torch._fused_sdp_choice(q, k, v, mask, p, causal, enable_gqa=gqa))
        except Exception as exc:
            choice = repr(exc)
        res["choices"].append({"case": name, "choice": choice})
        for backend, bname in names.items():
            q, k, v, mask = make()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            entry = {"case": name, "backend": bname}
            try:
                with sdpa_kernel([backend]):
                    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, mask, p, causal,
                                                                            enable_gqa=gqa)
                    torch.cuda.synchronize()
                    entry["fwd_retained"] = torch.cuda.memory_allocated() - base
                    entry["fwd_peak"] = torch.cuda.max_memory_allocated() - base
                    entry["out_stride"] = list(out.stride())
                    g = torch.randn_like(out)
                    base2 = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    out.backward(g)
                    torch.cuda.synchronize()
                    entry["bwd_peak"] = torch.cuda.max_memory_allocated() - base2
                    del out, g
                    entry["after_bwd"] = torch.cuda.memory_allocated() - base
                    entry["qkv_grad_bytes"] = sum(t.grad.untyped_storage().nbytes() for t in (q, k, v))
            except Exception as exc:
                entry["error"] = repr(exc)[:300]
            res["backends"].append(entry)
            del q, k, v, mask
    return res


def op_log(model_name: str, sample: dict, overrides: dict, strategy: dict) -> dict:
    """Every op of two training steps with the allocator's figures around it."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from harness.measure import set_allocator_env
    from memopt.models import SampleSpec, build_model, make_batch, with_overrides
    from memopt.step.prepare import prepare
    from memopt.strategy import Strategy

    parsed = Strategy.from_dict(strategy)
    set_allocator_env(parsed.expandable_segments)  # the allocator of the measured rows (before CUDA starts)
    torch.cuda.init()
    torch.manual_seed(0)
    spec = with_overrides(model_name, overrides)
    model = build_model(spec, device="cuda")
    batch = make_batch(spec, SampleSpec.parse(sample, spec), device="cuda")
    prepared = prepare(model, parsed, device_type="cuda", device="cuda")
    records: list = []
    phase = ["start"]
    prepared.step.on_phase = lambda name: phase.__setitem__(0, name)

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            a0 = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = func(*args, **(kwargs or {}))
            a1 = torch.cuda.memory_allocated()
            pk = torch.cuda.max_memory_allocated()
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_cuda]
            nbytes = sum(t.untyped_storage().nbytes() for t in outs)
            records.append([func.__name__, phase[0], a0, a1 - a0, pk - a0, nbytes,
                            [list(t.shape) for t in outs][:3], [str(t.dtype)[6:] for t in outs][:3]])
            return out

    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    peaks = []
    with Log():
        for _ in range(2):
            torch.cuda.reset_peak_memory_stats()
            prepared.step.step(batch)
            peaks.append(torch.cuda.max_memory_allocated())
    return {"model": model_name, "sample": sample, "overrides": overrides, "strategy": strategy,
            "start_allocated": start, "step_peaks": peaks, "records": records}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--ops-out", default="", help="write per-op logs (gzip JSON) here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_probe.py needs a CUDA GPU")
        return 2
    result = {"env": _fork(env_and_overhead), "sdpa": _fork(sdpa_facts)}
    print(json.dumps(result["env"], indent=1))
    for c in result["sdpa"].get("choices", []):
        print("sdpa choice", c)
    if args.ops_out:
        bf16 = {"precision": "bf16_autocast", "optimizer": "adamw_fused", "micro_batch_size": 2}
        cases = [
            ("llama32_1b", {"batch_size": 2, "seq_len": 1024}, {"num_hidden_layers": 2}, bf16),
            ("gpt2_medium", {"batch_size": 2, "seq_len": 1024}, {"n_layer": 2}, bf16),
            ("bert_large", {"batch_size": 2, "seq_len": 512}, {"num_hidden_layers": 2}, bf16),
            ("t5_base", {"batch_size": 2, "seq_len": 512}, {"num_layers": 2, "num_decoder_layers": 2}, bf16),
            ("vit_base", {"batch_size": 2, "image_size": 224}, {"num_hidden_layers": 2}, bf16),
            ("qwen2_moe_small", {"batch_size": 2, "seq_len": 512}, {"num_hidden_layers": 2}, bf16),
        ]
        logs = []
        for name, sample, overrides, strategy in cases:
            log = _fork(op_log, name, sample, overrides, strategy)
            print("op log", name, len(log.get("records", [])), log.get("error", ""), log.get("step_peaks"))
            logs.append(log)
        with gzip.open(args.ops_out, "wt") as f:
            json.dump(logs, f)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
