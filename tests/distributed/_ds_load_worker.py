"""Pretrained weights into DeepSpeed's layout on the CPU in one process: a model built on the meta device, filled
from a safetensors file at ZeRO-2 and at ZeRO-3, trains as the model built with those weights (run as a script:
DeepSpeed's accelerator is chosen at import)."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")


def main(out: str, port: str, weights: str) -> None:
    os.environ["MASTER_PORT"] = port
    import deepspeed.ops
    import torch
    from safetensors.torch import save_file

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    sys.path.insert(0, os.path.dirname(__file__))
    import _workers as w

    from memopt.distributed.deepspeed_engine import build_deepspeed
    from memopt.distributed.train_step import DistributedTrainStep
    from memopt.strategy import Strategy
    from memopt.techniques.sharding import ShardingSetting

    trained = w.tiny_model(seed=5)  # weights no fresh model has: the load must bring them
    save_file({k: v.contiguous() for k, v in trained.state_dict().items()}, weights)
    strategy = Strategy(precision="fp32", micro_batch_size=2, grad_accum_steps=4)
    results = {}
    for stage in (0, 2, 3):
        if stage == 0:  # the reference: the model built with the weights, ZeRO-2
            model, ckpt, s = w.tiny_model(seed=5), None, 2
        else:
            with torch.device("meta"):
                model = w.tiny_model(seed=0)
            ckpt, s = [weights], stage
        setting = ShardingSetting(engine="deepspeed", stage=s, world_size=1)
        engine, opt = build_deepspeed(model, setting, "fp32", lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                                      micro_batch=2, grad_accum=4, checkpoint=ckpt, load_device="cpu")
        step = DistributedTrainStep(model=engine, optimizer=opt, strategy=strategy, device_type="cpu",
                                    engine=engine, world_size=1)
        results[f"stage{stage}"] = [step.step(w.global_batch(i * w.GLOBAL_BATCH)) for i in range(2)]
    # a tied embedding (GPT-2's head is its token embedding; the file holds it once, as Hugging Face writes it):
    # still one parameter after the load, and the loaded model computes what the original does
    from memopt.models import build_model

    torch.manual_seed(0)
    real = build_model("tiny_gpt2", device="cpu").float().eval()
    state = {k: v.contiguous() for k, v in real.state_dict().items() if k != "lm_head.weight"}
    save_file(state, weights + ".gpt2")
    ids = torch.randint(0, real.config.vocab_size, (2, 16))
    with torch.no_grad():
        expected = real(input_ids=ids).logits
    for stage in (2, 3):
        with torch.device("meta"):
            model = build_model("tiny_gpt2", device="meta").float()
        setting = ShardingSetting(engine="deepspeed", stage=stage, world_size=1)
        engine, _ = build_deepspeed(model, setting, "fp32", lambda ps: torch.optim.AdamW(ps, lr=1e-3), micro_batch=2,
                                    checkpoint=[weights + ".gpt2"], load_device="cpu")
        engine.module.eval()
        with torch.no_grad():
            got = engine(input_ids=ids).logits
        results[f"tied_stage{stage}"] = {"still_tied": model.lm_head.weight is model.transformer.wte.weight,
                                         "max_abs_diff": float((got - expected).abs().max())}
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
