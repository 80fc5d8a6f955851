#!/usr/bin/env python3
"""ZeRO-Infinity on one H200 (issue 5): parameters and optimizer states on NVMe, DeepSpeed's async I/O op built
against the libaio carried in ``.aio/`` (the GPU machine has no libaio and no internet).

Run (repo root; carry ``[".whl", ".aio"]``):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=$PWD:/tmp/site
    python3 scripts/nvme_offload_gpu.py --out $OUT/nvme --deadline 280

``.aio/`` holds Debian 12's libaio 0.3.113 (``lib/libaio.so.1``, ``lib/libaio.so``, ``include/libaio.h``; it needs only
libc). Steps:

1. the environment DeepSpeed's ``AsyncIOBuilder`` reads: ``CFLAGS``/``LDFLAGS`` for its ``io_submit`` probe
   (``is_compatible``), ``CPATH``/``LIBRARY_PATH`` for the JIT compile and its ``-laio`` link (and ``-lcuda``: the
   toolkit's stub directory is appended), ``LD_LIBRARY_PATH`` for loading ``async_io.so`` in the case process (this
   process never loads it);
2. the async_io op and CPUAdam are JIT-built at the same time in two subprocesses, with timeouts and their logs kept
   in DIR; a failed aio build stops the run with its log tail (exit 2) -- it never hangs;
3. the case (``harness.measure_sharded`` in a fresh process: ZeRO-3, ``offload_param`` and
   ``offload_optimizer`` to ``--nvme-dir``, bf16, full checkpointing, a hard per-process GPU cap) and memopt's
   prediction of it (per-GPU peaks, host and NVMe bytes, step time), made here;
4. DIR/nvme.json (everything) and DIR/nvme.md (one table row).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "scripts"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from validate_sharding_gpu import launch, prebuild_deepspeed_ops  # noqa: E402

from harness.sharded_cases import ShardedCase, predict_case  # noqa: E402
from memopt.strategy import Checkpointing  # noqa: E402
from memopt.units import GiB  # noqa: E402

#: the aio op's JIT build (12 C++ files and pin_memory) and CPUAdam's run side by side; ~2 min on 16 cores
BUILD_TIMEOUT_S = 240.0
#: DeepSpeed's io_submit probe imports distutils, which Python 3.12 has only through setuptools
AIO_BUILD_CODE = """
import setuptools  # noqa: F401
from deepspeed.ops.op_builder import AsyncIOBuilder
b = AsyncIOBuilder()
if not b.is_compatible(verbose=True):
    raise SystemExit("AsyncIOBuilder.is_compatible() is False: DeepSpeed's io_submit probe did not compile and link "
                     "against libaio with CFLAGS/LDFLAGS (see the warnings above)")
b.load(verbose=True)
print("async_io ok")
"""


def aio_env(aio_dir: Path, environ: dict[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default ``os.environ``) with the paths that let DeepSpeed build and load its aio op against
    ``aio_dir``; raises ``SystemExit`` naming what is missing."""
    env = dict(os.environ if environ is None else environ)
    inc, lib = aio_dir / "include", aio_dir / "lib"
    missing = [str(p) for p in (inc / "libaio.h", lib / "libaio.so", lib / "libaio.so.1") if not p.exists()]
    if missing:
        raise SystemExit(f"libaio is not carried: {missing} missing (copy them from a Debian machine with libaio-dev: "
                         "/usr/include/libaio.h and /usr/lib/x86_64-linux-gnu/libaio.so.1, and carry '.aio')")

    def prepend(key: str, value: str, sep: str = os.pathsep) -> None:
        env[key] = value + (sep + env[key] if env.get(key) else "")

    prepend("CFLAGS", f"-I{inc}", " ")
    prepend("LDFLAGS", f"-L{lib} -Wl,-rpath,{lib}", " ")
    prepend("CPATH", str(inc))
    prepend("LIBRARY_PATH", str(lib))
    prepend("LD_LIBRARY_PATH", str(lib))
    # the CUDA build of the op also links -lcuda: where the driver brings only libcuda.so.1, the toolkit's link stub
    # (same soname, so the driver's library is what loads) lets the link succeed
    from torch.utils.cpp_extension import CUDA_HOME

    stubs = Path(CUDA_HOME or "/nonexistent") / "lib64" / "stubs"
    if (stubs / "libcuda.so").exists():
        env["LIBRARY_PATH"] += os.pathsep + str(stubs)
    # DeepSpeed's builder cannot parse an arch such as "9.0a" (the GPU image's TORCH_CUDA_ARCH_LIST)
    from memopt.distributed.deepspeed_engine import prepare_deepspeed_build_env

    prepare_deepspeed_build_env(env)
    return env


def build_aio(out: Path, timeout: float) -> dict[str, Any]:
    """JIT-build DeepSpeed's async_io op in a subprocess (the environment is this process's); its log in ``out``."""
    t = time.perf_counter()
    env = {**os.environ, "MAX_JOBS": os.environ.get("MAX_JOBS", str(os.cpu_count() or 8))}
    try:
        proc = subprocess.run([sys.executable, "-c", AIO_BUILD_CODE], capture_output=True, text=True, env=env,
                              timeout=timeout, cwd=ROOT)
        ok, text = proc.returncode == 0, proc.stdout[-20000:] + "\n--- stderr ---\n" + proc.stderr[-20000:]
    except subprocess.TimeoutExpired as exc:
        ok, text = False, f"timed out after {timeout:.0f} s\n{exc.stdout or ''}\n--- stderr ---\n{exc.stderr or ''}"
    (out / "build_async_io.log").write_text(text)
    return {"ok": ok, "build_s": time.perf_counter() - t, "log_tail": "" if ok else text[-3000:]}


def the_case(args: argparse.Namespace) -> ShardedCase:
    return ShardedCase(id="zero3_nvme_all", model=args.model, engine="deepspeed", stage=3, offload_optimizer="nvme",
                       offload_params="nvme", nvme_path=str(args.nvme_dir), world_size=1,
                       cap_bytes=int(args.cap_gib * GiB), global_batch=args.global_batch, seq_len=args.seq_len,
                       micro_batch=1, checkpointing=Checkpointing(mode="full"), role="diag", steps=args.steps)


def summary_md(res: dict[str, Any]) -> str:
    row, pred = res.get("row") or {}, res["prediction"]

    def gib(v: Any) -> str:
        return "" if v is None else f"{v / GiB:.2f}"

    nvme = (row.get("nvme_swap_bytes") or {}).get("total")
    step = row.get("measured_step_s")
    return "\n".join([
        "| case | ok | peak alloc GiB (pred) | peak reserved GiB (pred) | host RSS GiB (pred host) | "
        "NVMe GiB written (planned) | step s (pred) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| {res['case']['id']} {res['label']} | {row.get('ok')}{' OOM' if row.get('oom') else ''} | "
        f"{gib(row.get('measured_peak_allocated_bytes'))} ({gib(pred.get('predicted_peak_allocated_bytes'))}) | "
        f"{gib(row.get('measured_peak_reserved_bytes'))} ({gib(pred.get('predicted_peak_reserved_bytes'))}) | "
        f"{gib(row.get('host_rss_peak_bytes'))} ({gib(pred.get('predicted_host_bytes_per_rank'))}) | "
        f"{gib(nvme)} ({gib(pred.get('predicted_nvme_bytes_per_node'))}) | "
        f"{'' if step is None else f'{step:.2f}'} ({pred.get('predicted_step_s', 0):.2f}) |",
        "" if row.get("ok") else f"\nerror: {str(row.get('error', res.get('error', '')))[:500]}\n"]).rstrip() + "\n"


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.update(aio_env(Path(args.aio_dir).resolve()))
    Path(args.nvme_dir).mkdir(parents=True, exist_ok=True)
    case = the_case(args)
    res: dict[str, Any] = {"case": case.to_dict(), "label": case.label(),
                           "env": {k: os.environ[k] for k in ("CFLAGS", "LDFLAGS", "CPATH", "LIBRARY_PATH",
                                                              "LD_LIBRARY_PATH")}}
    left = args.deadline - 30.0 if args.deadline else BUILD_TIMEOUT_S + 300.0
    cpu_adam: dict[str, Any] = {}
    adam = threading.Thread(target=lambda: cpu_adam.update(prebuild_deepspeed_ops(out / "build_cpu_adam.log")),
                            daemon=True)
    adam.start()
    res["build_async_io"] = build_aio(out, min(BUILD_TIMEOUT_S, left))
    try:  # while CPUAdam may still build
        res["prediction"] = predict_case(case)
    except Exception as exc:  # the measurement still runs; the report says why there is no prediction
        res["prediction"] = {"error": f"{type(exc).__name__}: {exc}"}
    adam.join(timeout=max(1.0, min(BUILD_TIMEOUT_S, left) - (time.perf_counter() - t0)))
    res["build_cpu_adam"] = cpu_adam or {"ok": False, "error": "CPUAdam's build did not finish in time"}
    print(f"[build] async_io {res['build_async_io']['ok']} in {res['build_async_io']['build_s']:.0f} s, "
          f"cpu_adam {cpu_adam.get('ok')} in {cpu_adam.get('prebuild_s', 0):.0f} s", flush=True)
    failed = [name for name in ("build_async_io", "build_cpu_adam") if not res[name].get("ok")]
    if not failed:
        remaining = (args.deadline - (time.perf_counter() - t0) - 5.0) if args.deadline else 600.0
        if remaining < 60:
            res["error"] = f"no time left for the case ({remaining:.0f} s before the deadline)"
        else:
            rows = launch(case, out / case.id, remaining)
            res["row"] = rows[0]
    else:
        res["error"] = f"DeepSpeed op build failed: {failed}; logs in {out}/build_*.log"
    res["wall_s"] = time.perf_counter() - t0
    (out / "nvme.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    (out / "nvme.md").write_text(summary_md(res))
    print((out / "nvme.md").read_text(), flush=True)
    if failed:
        print(f"ERROR: {res['error']}\n{res['build_async_io'].get('log_tail', '')}", file=sys.stderr, flush=True)
        return 2
    return 0 if (res.get("row") or {}).get("ok") else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="results directory (nvme.json, nvme.md, build and case logs)")
    ap.add_argument("--deadline", type=float, default=0.0, help="seconds from start by which everything ends")
    ap.add_argument("--model", default="qwen25_0_5b", help="a shipped model config (0.5B: ~7 GB of swap files)")
    ap.add_argument("--nvme-dir", default="/tmp/nvme_offload", help="the swap directory (local disk)")
    ap.add_argument("--aio-dir", default=str(ROOT / ".aio"), help="carried libaio (include/, lib/)")
    ap.add_argument("--cap-gib", type=float, default=8.0, help="hard per-process GPU memory cap")
    ap.add_argument("--global-batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
