#!/usr/bin/env python
"""Measure a validation matrix on the GPU: each row in a fresh (forked) process, results as JSON lines.

    python scripts/validate_gpu.py --matrix estimator --out benchmarks/validation/raw.jsonl

Then, on any machine (no GPU), ``python scripts/report_validation.py`` adds the estimator's predictions
and writes the JSON, markdown table and PNG scatter under ``benchmarks/``.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # is_available() must not start CUDA before fork
import torch
import transformers  # noqa: F401

from harness.matrices import matrix
from harness.measure import measure_row
from harness.rows import Row


def run_forked(row: Row, timeout_s: float) -> dict:
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: CUDA starts here, with this row's allocator settings
        os.close(read_fd)
        try:
            result = measure_row(row)
        except BaseException as exc:
            result = {"row": row.to_dict(), "ok": False, "error": repr(exc)}
        with os.fdopen(write_fd, "w") as f:
            f.write(json.dumps(result))
        os._exit(0)
    os.close(write_fd)
    deadline = time.time() + timeout_s
    chunks: list[bytes] = []
    while True:
        remaining = deadline - time.time()
        if remaining <= 0:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            os.close(read_fd)
            return {"row": row.to_dict(), "ok": False, "error": f"timeout after {timeout_s}s"}
        ready, _, _ = select.select([read_fd], [], [], min(remaining, 1.0))
        if ready:
            data = os.read(read_fd, 1 << 20)
            if not data:
                break
            chunks.append(data)
    os.close(read_fd)
    _, status = os.waitpid(pid, 0)
    text = b"".join(chunks).decode()
    if not text:
        return {"row": row.to_dict(), "ok": False, "error": f"child exited with status {status} and no result"}
    return json.loads(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--matrix", default="estimator")
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", default="", help="comma-separated substrings of row ids to run")
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("validate_gpu.py needs a CUDA GPU; none is visible. Nothing was measured.")
        return 2
    rows = matrix(args.matrix)
    if args.only:
        keys = args.only.split(",")
        rows = [r for r in rows if any(k in r.id for k in keys)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        for row in rows:
            t = time.time()
            result = run_forked(row, args.timeout)
            result["wall_s"] = time.time() - t
            f.write(json.dumps(result) + "\n")
            f.flush()
            status = "ok " if result.get("ok") else ("OOM" if result.get("oom") else "ERR")
            alloc = result.get("measured_peak_allocated_bytes", 0) / 2**30
            reserved = result.get("measured_peak_reserved_bytes", 0) / 2**30
            print(f"{status} {row.id:45s} alloc={alloc:7.2f}GiB reserved={reserved:7.2f}GiB "
                  f"step={result.get('measured_step_s', 0):.3f}s wall={result['wall_s']:.1f}s "
                  f"{result.get('error', '')[:150]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
