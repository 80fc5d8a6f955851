#!/usr/bin/env python
"""TRL's ``SFTTrainer`` with ``memopt.wrap(trainer, budget=...)`` added after it is built, against the same trainer
without memopt: losses, peak memory, and the plan's prediction. The data (random words of several lengths, so the
collator pads) and the tokenizer are made here; the model is a Llama built from a config with random weights.

    python scripts/trl_sft_gpu.py --size real --budget 16GiB --steps 20 --out OUT/sft.json   # a GPU
    python scripts/trl_sft_gpu.py --size tiny --budget 4GB --steps 3 --out /tmp/sft.json       # the CPU

Needs trl and datasets (not memopt's dependencies).
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SIZES = {
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 2, "rows": 64, "max_words": 60, "max_length": 64, "batch": 8},
    "real": {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 24, "num_attention_heads": 16,
             "num_key_value_heads": 8, "rows": 2000, "max_words": 2400, "max_length": 2048, "batch": 8},
}


def _assets(size: dict):
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(2, 7))) for _ in range(3000)]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(20, size["max_words"])))
             for _ in range(size["rows"])]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=8000, special_tokens=["<unk>", "<pad>", "</s>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    return Dataset.from_dict({"text": texts}), fast


def _run(use_memopt: bool, base, ds, tok, size: dict, args) -> dict:
    import torch
    from trl import SFTConfig, SFTTrainer

    import memopt

    cuda = torch.cuda.is_available()
    config = SFTConfig(output_dir=f"/tmp/sft_{use_memopt}", per_device_train_batch_size=size["batch"],
                       max_steps=args.steps, learning_rate=1e-4, logging_steps=1, report_to=[], save_strategy="no",
                       max_length=size["max_length"], use_cpu=not cuda, seed=0, dataloader_num_workers=0,
                       bf16=True, lr_scheduler_type="constant")
    torch.manual_seed(0)
    trainer = SFTTrainer(model=copy.deepcopy(base), args=config, train_dataset=ds, processing_class=tok)
    out: dict = {"memopt": use_memopt}
    start = time.perf_counter()
    if use_memopt:
        trainer = memopt.wrap(trainer, budget=args.budget, hardware=None if cuda else "h200")
        plan = trainer.memopt_plan
        out.update(plan=plan.strategy.label(), predicted_peak_allocated_bytes=plan.peak_allocated_bytes,
                   predicted_total_bytes=plan.total_bytes, budget_bytes=plan.budget_bytes,
                   predicted_step_s=plan.step_time_s, plan_s=time.perf_counter() - start)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.train()
    out["train_s"] = time.perf_counter() - start
    out["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if cuda:
        out["measured_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        out["measured_peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    trainer.model.to("cpu")
    del trainer
    if cuda:
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--budget", default="4GB")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    size = SIZES[args.size]
    ds, tok = _assets(size)
    cfg = LlamaConfig(vocab_size=len(tok), pad_token_id=tok.pad_token_id, max_position_embeddings=4096,
                      **{k: size[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                              "num_attention_heads", "num_key_value_heads")})
    torch.manual_seed(0)
    base = LlamaForCausalLM(cfg)
    rows = []
    for use in (True, False):  # memopt first: the plain run's caches then take nothing from memopt's peak
        rows.append(_run(use, base, ds, tok, size, args))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "losses"}), flush=True)
    wrapped, plain = rows
    report = {"size": args.size, "budget": args.budget, "steps": args.steps, "rows": rows,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "max_loss_relative_difference": max(abs(a - b) / abs(b) for a, b in zip(wrapped["losses"],
                                                                                      plain["losses"]))}
    if "measured_peak_allocated_bytes" in wrapped:
        report["allocated_error"] = (wrapped["predicted_peak_allocated_bytes"]
                                     / wrapped["measured_peak_allocated_bytes"] - 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}))


if __name__ == "__main__":
    main()
