"""DeepSpeed checkpoints across world sizes on the CPU (gloo): ``save`` runs under ``torchrun --nproc-per-node 2``
(ZeRO-3, two steps, saved, two more: the uninterrupted run); ``resume`` runs alone (ZeRO-2 at world size 1, the
checkpoint loaded through DeepSpeed's universal format, two steps)."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def main(mode: str, ckpt: str, out: str) -> None:
    """The run between joining the gloo group and leaving it. What the run made (the engine, its pending work
    handles) is freed when it returns, while the interpreter is whole: freed at interpreter exit instead, a gloo work
    object takes the GIL of a finalizing interpreter and the rank aborts with "terminate called without an active
    exception" (pytorch/pytorch#179291; seen in CI): ``_workers.run_then_leave_group``."""
    import torch.distributed as dist

    if mode == "resume":
        os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_PORT", sys.argv[4])
    dist.init_process_group("gloo")
    sys.path.insert(0, os.path.dirname(__file__))
    import _workers as w

    w.run_then_leave_group(_run, mode, ckpt, out)


def _run(mode: str, ckpt: str, out: str) -> None:
    import deepspeed.ops
    import torch
    import torch.distributed as dist

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT-built shared-memory allreduce
    import _workers as w

    from memopt.distributed.deepspeed_engine import build_deepspeed
    from memopt.distributed.ds_checkpoint import load_deepspeed, save_deepspeed
    from memopt.distributed.train_step import DistributedTrainStep, shard_batch
    from memopt.strategy import Strategy
    from memopt.techniques.sharding import ShardingSetting

    ws, rank = dist.get_world_size(), dist.get_rank()
    stage = 3 if mode == "save" else 2
    accum = 4 // ws  # global batch 8 = 2 per micro-batch x accum x ranks
    setting = ShardingSetting(engine="deepspeed", stage=stage, world_size=ws)
    engine, opt = build_deepspeed(w.tiny_model(seed=0 if mode == "save" else 3), setting, "fp32",
                                  lambda ps: torch.optim.AdamW(ps, lr=1e-2), micro_batch=2, grad_accum=accum)
    step = DistributedTrainStep(model=engine, optimizer=opt, device_type="cpu", engine=engine, world_size=ws,
                                strategy=Strategy(precision="fp32", micro_batch_size=2, grad_accum_steps=accum))

    def steps(n: int) -> list[float]:
        return [step.step(shard_batch(w.global_batch(step.samples_seen), rank, ws)) for _ in range(n)]

    if mode == "save":
        first = steps(2)
        save_deepspeed(engine, ckpt, stage=3, world_size=ws, steps_done=2, samples_seen=step.samples_seen)
        result = {"first": first, "uninterrupted": steps(2)}
    else:
        counters = load_deepspeed(engine, ckpt, stage=2, world_size=1)
        step.samples_seen = counters["samples_seen"]
        result = {"counters": counters, "losses": steps(2)}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
