"""One plain process (no launcher, no process group) applying a one-GPU offload plan through memopt.wrap.

Run as a script: ``python _offload_worker.py OUT ENGINE MODE [LOSS]``; ENGINE is fsdp2 or deepspeed, MODE ``plan`` (a
saved plan passed as plan=) or ``budget`` (wrap makes the plan: the planner's choice is fixed to that offload plan);
LOSS ``model`` (the model's own mean loss), ``summed`` (a training_step summing over the tokens) or ``stale`` (the
model's loss, with gradients of ones left on every parameter before each step)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("DS_ACCELERATOR", "cpu")
for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
    os.environ.pop(var, None)  # what a user who never heard of torch.distributed has


def main(out: str, engine: str, mode: str, loss: str = "model") -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))
    import _workers as w

    import memopt
    import memopt.apply.wrapped as wrapped_module
    from memopt.hardware import load_hardware
    from memopt.plan import Policy
    from memopt.plan.sharded import plan_sharded
    from memopt.techniques.sharding import ShardingSetting

    if engine.startswith("deepspeed"):
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # a JIT build one process does not need
    hw = load_hardware("h100_80gb")
    sample = w.global_batch(0)
    prof = memopt.profile(w.tiny_model(), sample, hardware=hw, use_cache=False)
    settings = {
        "fsdp2": ShardingSetting(engine="fsdp2", world_size=1, offload_optimizer="cpu", offload_params="cpu",
                                 pin_memory=False),
        "deepspeed": ShardingSetting(engine="deepspeed", stage=2, world_size=1, offload_optimizer="cpu",
                                     pin_memory=False),
        # no offload: DeepSpeed's own process-group handling over the group memopt started, without CPUAdam's build
        "deepspeed_zero2": ShardingSetting(engine="deepspeed", stage=2, world_size=1),
    }
    setting = settings[engine]
    plan, _ = plan_sharded(prof, hw, 1 << 40, Policy.build(), world_size=1, nodes=1, host_memory_bytes=1 << 40,
                           settings=[setting])
    # fp32 on the CPU, the reference's micro-batching: the trajectory is then comparable number for number
    plan = dataclasses.replace(plan, strategy=plan.strategy.replace(precision="fp32", micro_batch_size=2,
                                                                    grad_accum_steps=w.GLOBAL_BATCH // 2))
    assert not dist.is_initialized()
    model = w.tiny_model()
    model.config = SimpleNamespace(use_cache=True)  # as a Hugging Face model's: its forward keeps a KV cache
    model.gradient_checkpointing, model._gradient_checkpointing_func = True, None  # gradient_checkpointing_enable()
    user = {"training_step": w.summed_loss} if loss == "summed" else {}
    if mode == "plan":
        wrapped = memopt.wrap(model, plan=plan, device="cpu", lr=1e-2, **user)
    else:
        wrapped_module.make_plan = lambda *args, **kwargs: plan  # the planner's choice: this offload plan
        wrapped = memopt.wrap(model, budget="80GB", sample=sample, hardware=hw, device="cpu", lr=1e-2,
                              use_cache=False, **user)
    losses = []
    for s in range(3):
        if loss == "stale":  # what another loss left on the parameters (a GAN's other player) is not this step's
            for p in (getattr(wrapped, "engine", None) or wrapped.model).parameters():
                p.grad = torch.ones_like(p)
        losses.append(wrapped.step(w.global_batch(s * w.GLOBAL_BATCH)))
    engine_obj = getattr(wrapped, "engine", None) or wrapped.model
    result = {"losses": losses, "group": dist.is_initialized() and dist.get_world_size(),
              "engine": type(engine_obj).__name__, "wrapped": type(wrapped).__name__,
              "use_cache_in_training": model.config.use_cache,
              "own_checkpointing_in_training": model.gradient_checkpointing,
              "started_group": getattr(getattr(wrapped, "_sharded", wrapped), "started_group", None),
              "reduction": getattr(getattr(wrapped, "_reduction", None), "mode", None)}
    wrapped.close()
    result["group_after_close"] = dist.is_initialized()
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:5])
