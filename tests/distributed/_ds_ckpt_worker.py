"""DeepSpeed checkpoints on the CPU in one process: save at ZeRO-2, resume at ZeRO-2 and at ZeRO-3 (run as a
script: DeepSpeed's accelerator is chosen at import)."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")


def main(out: str, port: str, ckpt: str) -> None:
    os.environ["MASTER_PORT"] = port
    import deepspeed.ops
    import torch

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # one process: no JIT-built shm allreduce
    sys.path.insert(0, os.path.dirname(__file__))
    import _workers as w

    from memopt.distributed.deepspeed_engine import build_deepspeed
    from memopt.distributed.ds_checkpoint import load_deepspeed, save_deepspeed
    from memopt.distributed.train_step import DistributedTrainStep
    from memopt.strategy import Strategy
    from memopt.techniques.sharding import ShardingSetting

    strategy = Strategy(precision="fp32", micro_batch_size=2, grad_accum_steps=4)

    def engine_step(stage: int, seed: int):  # type: ignore[no-untyped-def]
        setting = ShardingSetting(engine="deepspeed", stage=stage, world_size=1)
        engine, opt = build_deepspeed(w.tiny_model(seed=seed), setting, "fp32",
                                      lambda ps: torch.optim.AdamW(ps, lr=1e-2), micro_batch=2, grad_accum=4)
        return engine, DistributedTrainStep(model=engine, optimizer=opt, strategy=strategy, device_type="cpu",
                                            engine=engine, world_size=1)

    def batch(position: int):  # type: ignore[no-untyped-def]
        return w.global_batch(position)

    def steps(step, n: int) -> list[float]:  # type: ignore[no-untyped-def]
        return [step.step(batch(step.samples_seen)) for _ in range(n)]

    # A: ZeRO-2, two steps, saved, then three more: the uninterrupted run (the second step after a resume depends
    # on the restored Adam moments and step count, not only on the weights)
    engine, step = engine_step(2, seed=0)
    first = steps(step, 2)
    save_deepspeed(engine, f"{ckpt}/a", stage=2, world_size=1, steps_done=2, samples_seen=step.samples_seen)
    results = {"first": first, "uninterrupted": steps(step, 3), "samples_seen_saved": 2 * w.GLOBAL_BATCH}

    def resume(stage: int, where: str, seed: int):  # type: ignore[no-untyped-def]
        engine, step = engine_step(stage, seed=seed)  # other initial weights: the checkpoint must overwrite them
        counters = load_deepspeed(engine, f"{ckpt}/{where}", stage=stage, world_size=1)
        step.samples_seen = counters["samples_seen"]
        return engine, step, counters

    _, step, counters = resume(2, "a", seed=1)
    results["same_stage"] = {"counters": counters, "losses": steps(step, 2)}
    engine, step, counters = resume(3, "a", seed=1)
    results["zero3"] = {"counters": counters, "losses": steps(step, 1)}
    # B: that ZeRO-3 run, three steps in, saved and resumed at ZeRO-2
    save_deepspeed(engine, f"{ckpt}/b", stage=3, world_size=1, steps_done=3, samples_seen=step.samples_seen)
    results["zero3"]["losses"] += steps(step, 1)
    _, step, counters = resume(2, "b", seed=2)
    results["zero3_to_zero2"] = {"counters": counters, "losses": steps(step, 2)}
    results["files"] = sorted(os.listdir(f"{ckpt}/a"))
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
