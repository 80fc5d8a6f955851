"""Measuring one sharded case on the GPU(s), one fresh process per rank (``python -m`` or ``torchrun -m``).

As ``harness.measure``: the allocator is configured before CUDA starts, the model is built on the
GPU from its config and handed to the engine (DeepSpeed ``initialize`` or FSDP2 ``fully_shard``), the
cache is emptied, the hard cap is set with ``torch.cuda.set_per_process_memory_fraction`` and the peak
statistics are reset before the first step. Host RSS is sampled from ``/proc/self/status`` during the
steps (pinned offload buffers count there). One JSON object per rank is written to ``--out`` + ``.rank<r>``.

    python -m harness.measure_sharded --case '<ShardedCase JSON>' --out DIR/case
    torchrun --nproc-per-node 2 -m harness.measure_sharded --case ... --out ...
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
import traceback
from typing import Any

from harness.measure import set_allocator_env
from harness.sharded_cases import ShardedCase, case_deepspeed_config, model_facts

__all__ = ["RssSampler", "free_port", "run_case"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class RssSampler:
    """Peak resident set size of this process, sampled every ``interval`` seconds while entered."""

    def __init__(self, interval: float = 0.1) -> None:
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes())
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        self.peak = _rss_bytes()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, _rss_bytes())


def _init_distributed(world_size: int) -> tuple[int, int]:
    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ:
        if world_size != 1:
            raise ValueError(f"a case with world_size {world_size} runs under torchrun --nproc-per-node "
                             f"{world_size}; without torchrun only world_size 1 runs")
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if int(os.environ["WORLD_SIZE"]) != world_size:
        raise ValueError(f"the case needs world_size {world_size}, the launcher started {os.environ['WORLD_SIZE']}")
    torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    return rank, local


def _checkpointing(model: Any, case: ShardedCase) -> None:
    if case.checkpointing.mode == "none":
        return
    if case.ckpt_impl == "hf":
        model.gradient_checkpointing_enable()  # what users call: Hugging Face's defaults
        return
    from memopt.blocks import find_block_stacks
    from memopt.techniques.checkpointing import apply_checkpointing

    apply_checkpointing(find_block_stacks(model), case.checkpointing)


def timed_steps(step: Any, batch: Any, steps: int) -> tuple[list[float], list[float]]:
    """``steps`` calls of ``step(batch)``, each timed between two CUDA synchronizations: (losses, seconds)."""
    import torch

    losses: list[float] = []
    times: list[float] = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        losses.append(step(batch))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return losses, times


def pools_by_stream(torch: Any, device: int) -> dict[str, Any]:
    """Reserved and allocated bytes per CUDA stream's allocator pool (``torch.cuda.memory._snapshot``'s segments),
    the default stream's first. With expandable segments a pool keeps what it grew to (unless the allocator had to
    release memory: ``num_alloc_retries`` > 0), so after the steps this is each pool's peak."""
    default = torch.cuda.default_stream(device).cuda_stream
    pools: dict[int, dict[str, int]] = {}
    for seg in torch.cuda.memory._snapshot()["segments"]:
        if seg.get("device", device) != device:
            continue
        pool = pools.setdefault(int(seg["stream"]), {"reserved_bytes": 0, "allocated_bytes": 0, "segments": 0})
        pool["reserved_bytes"] += int(seg["total_size"])
        pool["allocated_bytes"] += int(seg["allocated_size"])
        pool["segments"] += 1
    ordered = sorted(pools.items(), key=lambda kv: (kv[0] != default, -kv[1]["reserved_bytes"]))
    return {"reserved_by_stream": [{"stream": "default" if k == default else f"side{i}", **v}
                                   for i, (k, v) in enumerate(ordered)]}


def run_case(case: ShardedCase) -> dict[str, Any]:
    """Build, shard and train ``case.steps`` steps on this rank's GPU; the measured figures or the error."""
    set_allocator_env(case.expandable_segments)
    import torch

    from memopt.distributed.train_step import DistributedTrainStep, shard_batch
    from memopt.models import SampleSpec, build_model, make_batch
    from memopt.strategy import Strategy

    result: dict[str, Any] = {"case": case.to_dict(), "label": case.label(), "grad_accum": case.grad_accum,
                              "rank": int(os.environ.get("RANK", "0")), "ok": False, "oom": False}
    t_start = time.perf_counter()
    try:
        rank, local = _init_distributed(case.world_size)
        result["rank"] = rank
        torch.manual_seed(0)
        device = torch.device("cuda", local)
        model = build_model(case.model, device=device)
        model.config.use_cache = False
        _checkpointing(model, case)
        strategy = Strategy(precision="bf16_pure", micro_batch_size=case.micro_batch, grad_accum_steps=case.grad_accum)
        if case.engine == "deepspeed":
            import deepspeed

            from memopt.distributed.deepspeed_engine import prepare_deepspeed_build_env
            from memopt.distributed.host_tier import validate_offload

            if case.nvme_path:  # a missing or read-only swap directory fails here, not in the first swap
                import setuptools  # noqa: F401  (DeepSpeed's libaio probe imports distutils: Python 3.12 has it so)

                result["nvme_checked"] = validate_offload(case.setting(), num_params=model_facts(case.model).num_params)

            config = case_deepspeed_config(case)
            result["deepspeed_config"] = config
            prepare_deepspeed_build_env()
            engine, optimizer, _, _ = deepspeed.initialize(
                model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=config)
            step = DistributedTrainStep(model=engine, optimizer=optimizer, strategy=strategy, device_type="cuda",
                                        device=device, engine=engine, world_size=case.world_size)
            result["optimizer"] = type(getattr(optimizer, "optimizer", optimizer)).__name__
        else:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            from memopt.blocks import find_block_stacks
            from memopt.distributed.torch_engines import apply_fsdp2
            from memopt.techniques.sharding import ShardingSetting

            setting = ShardingSetting(engine="fsdp2", world_size=case.world_size,
                                      offload_optimizer=case.offload_optimizer,  # type: ignore[arg-type]
                                      offload_params=case.offload_params)  # type: ignore[arg-type]
            apply_fsdp2(model, setting, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                        find_block_stacks(model), device_type="cuda")
            kw = {"fused": True} if case.fsdp_optimizer == "fused" else {"foreach": True}
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, **kw)
            step = DistributedTrainStep(model=model, optimizer=optimizer, strategy=strategy, device_type="cuda",
                                        device=device, world_size=case.world_size)
            result["optimizer"] = f"torch.optim.AdamW({kw})"
        spec_sample = SampleSpec.parse({"batch_size": case.global_batch, "seq_len": case.seq_len}, case.model)
        g = torch.Generator().manual_seed(0)
        batch = shard_batch(make_batch(case.model, spec_sample, device="cpu", generator=g), rank, case.world_size)
        result["build_s"] = time.perf_counter() - t_start
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, case.cap_bytes / total), device)
        torch.cuda.reset_peak_memory_stats()
        result.update({"start_allocated_bytes": torch.cuda.memory_allocated(),
                       "start_reserved_bytes": torch.cuda.memory_reserved(), "device_total_bytes": total})
        with RssSampler() as rss:
            try:
                losses, times = timed_steps(step.step, batch, case.steps)
            finally:
                result["host_rss_peak_bytes"] = rss.peak
        steady = statistics.median(times[1:]) if len(times) > 1 else times[0]
        free, _ = torch.cuda.mem_get_info()
        reserved = torch.cuda.max_memory_reserved()
        from memopt.step.hard_cap import process_device_bytes

        own = process_device_bytes(local)
        result.update({
            "ok": True,
            "measured_peak_allocated_bytes": torch.cuda.max_memory_allocated(),
            "measured_peak_reserved_bytes": reserved,
            "measured_outside_allocator_bytes": (own if own is not None else total - free)
            - torch.cuda.memory_reserved(),
            "measured_step_s": steady, "step_times_s": times, "losses": losses,
            "tokens_per_s": case.tokens_per_step / steady,
            "fits_under_cap": reserved <= case.cap_bytes,
            "num_alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0),
            **pools_by_stream(torch, local),
        })
        if case.nvme_path:
            from memopt.distributed.host_tier import nvme_swap_bytes

            result["nvme_swap_bytes"] = nvme_swap_bytes(case.nvme_path)
    except torch.cuda.OutOfMemoryError as exc:
        result.update({"ok": True, "oom": True, "fits_under_cap": False, "error": str(exc)[:1500],
                       "measured_peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                       "measured_peak_reserved_bytes": torch.cuda.max_memory_reserved()})
    except Exception as exc:
        result.update({"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000],
                       "traceback": traceback.format_exc()[-4000:]})
    result["wall_s"] = time.perf_counter() - t_start
    import resource

    result["host_maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", required=True, help="a ShardedCase as JSON")
    ap.add_argument("--out", required=True, help="output path prefix; each rank writes <out>.rank<r>.json")
    args = ap.parse_args(argv)
    case = ShardedCase.from_dict(json.loads(args.case))
    result = run_case(case)
    path = f"{args.out}.rank{result['rank']}.json"
    with open(path, "w") as f:
        json.dump(result, f)
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # the row is written; a teardown error changes nothing
        pass
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
