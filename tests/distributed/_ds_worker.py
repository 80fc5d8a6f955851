"""DeepSpeed on the CPU in one process (run as a script: DeepSpeed's accelerator is chosen at import)."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")


def main(out: str, port: str, configs: list[dict]) -> None:
    os.environ["MASTER_PORT"] = port
    import deepspeed
    import deepspeed.ops
    import torch

    # the shared-memory allreduce op is JIT-compiled on first use (minutes); one process does not need it
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    sys.path.insert(0, os.path.dirname(__file__))
    import _workers as w

    from memopt.distributed.deepspeed_engine import build_deepspeed
    from memopt.distributed.train_step import DistributedTrainStep
    from memopt.strategy import Strategy
    from memopt.techniques.sharding import ShardingSetting

    results = {}
    for cfg in configs:
        name = cfg.pop("name")
        opt_kind = cfg.pop("optimizer", "torch")
        steps = cfg.pop("steps", 3)
        dims = cfg.pop("dims", None)  # TinyLM(vocab, d, n): NVMe swaps only tensors of 1 MiB and more
        setting = ShardingSetting(engine="deepspeed", world_size=1, **cfg)
        model = w.tiny_model() if dims is None else w.tiny_model(dims=dims)
        optimizer = (lambda ps: torch.optim.AdamW(ps, lr=1e-2)) if opt_kind == "torch" else \
            {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}
        traffic = w.AioTraffic() if setting.nvme_path else None
        engine, opt = build_deepspeed(model, setting, "fp32", optimizer, micro_batch=2, grad_accum=4)
        strategy = Strategy(precision="fp32", micro_batch_size=2, grad_accum_steps=4)
        step = DistributedTrainStep(model=engine, optimizer=opt, strategy=strategy, device_type="cpu",
                                    engine=engine, world_size=1)
        after_init = dict(traffic.bytes) if traffic else None
        losses = [step.step(w.global_batch(s * w.GLOBAL_BATCH)) for s in range(steps)]
        results[name] = {"losses": losses, "optimizer": type(opt).__name__,
                         "inner": type(getattr(opt, "optimizer", opt)).__name__,
                         "num_params": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                                           for p in model.parameters())}
        if traffic is not None:
            from memopt.distributed.host_tier import nvme_swap_bytes

            results[name].update({"nvme_swap_bytes": nvme_swap_bytes(setting.nvme_path), "aio_init": after_init,
                                  "aio_steps": {k: v - after_init[k] for k, v in traffic.bytes.items()},
                                  "param_numels": [p.ds_numel for p in model.parameters()]})
            traffic.close()
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
    # the results are written: leave without the interpreter's teardown, where DeepSpeed's and gloo's threads
    # sometimes abort the process ("terminate called without an active exception", exit -6) after the work is done
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
