"""Where the bytes go, measured on the GPU beside memopt's prediction: one JSON file per model.

For each model (built from a config, random weights, nothing downloaded) ``memopt.wrap`` plans for the local GPU
and trains a few steps with a run directory; the second step (the steady state: optimizer states exist) is
recorded by module and op (``memopt.guard.attribution``: per-tensor dispatch tracker with module hooks, the
allocator's counter per op and its own history). Each row has ``predicted_by_category_bytes`` and
``measured_by_category_bytes`` at the step's peak, ``by_module`` (predicted and measured per module group), the
allocator's own peak, and whether every category is within 3% of the predicted peak.

    PYTHONUNBUFFERED=1 python scripts/attribution_gpu.py --out /tmp/attribution_rows
    python scripts/report_attribution.py /tmp/attribution_rows --out benchmarks/attribution

``--cpu`` runs the same flow on the CPU (planning for an H200), to check the script without a GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

# (name, family, base config, overrides, sample): sizes small enough that six models plan and run in ~4 minutes
MODELS: list[tuple[str, str, str, dict[str, Any], dict[str, Any]]] = [
    ("llama", "decoder (Llama-shaped)", "tiny_llama",
     {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
      "num_key_value_heads": 4, "vocab_size": 16384, "max_position_embeddings": 2048},
     {"batch_size": 8, "seq_len": 1024}),
    ("gpt2", "decoder (GPT-2)", "tiny_gpt2",
     {"n_embd": 768, "n_layer": 8, "n_head": 12, "vocab_size": 16384, "n_positions": 1024},
     {"batch_size": 8, "seq_len": 1024}),
    ("bert", "encoder (BERT, masked LM)", "tiny_bert",
     {"hidden_size": 768, "num_hidden_layers": 8, "num_attention_heads": 12, "intermediate_size": 3072,
      "vocab_size": 16384, "max_position_embeddings": 512}, {"batch_size": 16, "seq_len": 512}),
    ("t5", "encoder-decoder (T5)", "tiny_t5",
     {"d_model": 512, "d_kv": 64, "d_ff": 2048, "num_layers": 6, "num_decoder_layers": 6, "num_heads": 8,
      "vocab_size": 16384}, {"batch_size": 16, "seq_len": 512, "decoder_seq_len": 128}),
    ("vit", "vision (ViT)", "tiny_vit",
     {"hidden_size": 768, "num_hidden_layers": 8, "num_attention_heads": 12, "intermediate_size": 3072,
      "image_size": 224, "patch_size": 16, "encoder_stride": 16, "num_labels": 1000},
     {"batch_size": 64, "image_size": 224}),
    ("mlp", "custom MLP stack", "", {"dim": 2048, "layers": 8, "vocab": 16384}, {"batch_size": 16, "seq_len": 512}),
]


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(F.gelu(self.fc1(self.norm(h))))


class MLPLM(nn.Module):
    """A custom model: embedding, a stack of pre-norm MLP blocks, a head, its own loss."""

    def __init__(self, dim: int, layers: int, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        logits = self.head(h)
        return {"loss": F.cross_entropy(logits.reshape(-1, self.vocab).float(), labels.reshape(-1))}


def _build(name: str, base: str, overrides: dict[str, Any], sample: dict[str, Any]) -> tuple[nn.Module, Any, Any]:
    """(model on the CPU, the sample wrap plans for, a function giving batch i)."""
    if not base:
        model = MLPLM(**overrides)
        b, t = sample["batch_size"], sample["seq_len"]

        def batch(i: int) -> dict[str, torch.Tensor]:
            g = torch.Generator().manual_seed(i)
            ids = torch.randint(0, overrides["vocab"], (b, t), generator=g)
            return {"input_ids": ids, "labels": ids.roll(-1, dims=1)}

        return model, batch(0), batch
    from memopt.models import SampleSpec, build_model, make_batch, with_overrides

    spec = with_overrides(base, overrides)
    model = build_model(spec, device="cpu")
    parsed = SampleSpec.parse(sample, spec)

    def batch(i: int) -> dict[str, torch.Tensor]:
        return make_batch(spec, parsed, generator=torch.Generator().manual_seed(i))

    from memopt.profile.api import spec_from_module

    # a model whose class names no task (GPT2LMHeadModel) is planned from a batch of tensors, not from shapes
    return model, sample if spec_from_module(model) is not None else batch(0), batch


def _by_module(predicted: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    groups = list(predicted.get("groups", [])) + [g for g in measured.get("groups", [])
                                                  if g not in predicted.get("groups", [])]
    pg, mg = predicted.get("by_group", {}), measured.get("by_group", {})
    return {g: {"predicted": pg.get(g, {}), "measured": mg.get(g, {})} for g in groups}


def _zoo_model(row_id: str) -> tuple[nn.Module, Any, Any, str]:
    """A row of ``zoo_matrix_gpu.py``: (model, sample, batch function, budget)."""
    sys.path.insert(0, str(REPO / "scripts"))
    import zoo_matrix_gpu as zoo

    row = next(r for r in zoo.ROWS if r.id == row_id)
    if row.kind in ("custom", "torchvision") or row.extra:
        raise SystemExit(f"--zoo takes Hugging Face rows called as model(**batch); {row_id} is {row.kind}")
    model = zoo.build(row)
    batch = zoo.batch_for(row, model)
    return model, batch, lambda i: batch, row.budget


def run_one(name: str, family: str, base: str, overrides: dict[str, Any], sample: dict[str, Any], out: Path,
            steps: int, device: str, budget: str) -> dict[str, Any]:
    import memopt
    from memopt.report import render_report

    gc.collect()  # the previous model's memory must be gone: it would count as this run's
    if device == "cuda":
        torch.cuda.empty_cache()
    allocated_before = torch.cuda.memory_allocated() if device == "cuda" else 0
    torch.manual_seed(0)
    t0 = time.perf_counter()
    if family == "zoo":
        model, plan_sample, batch, budget = _zoo_model(name)
    else:
        model, plan_sample, batch = _build(name, base, overrides, sample)
    run_dir = out / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    hardware = "auto" if device == "cuda" else "h200"
    w = memopt.wrap(model, budget=budget, sample=plan_sample, hardware=hardware, lr=1e-4, run_dir=run_dir,
                    autotune=False, device=None if device == "cuda" else device)
    w.attribution_step = 1  # the steady state: the first step creates the optimizer states
    plan_s = time.perf_counter() - t0
    losses = [w.step(batch(i)) for i in range(steps)]
    w.close()
    measured = json.loads((run_dir / "attribution_measured.json").read_text())
    attr = w.plan.prediction.get("attribution") or {}
    predicted = (attr.get("steps") or [{}])[-1]
    peak = predicted.get("peak_allocated_bytes") or 0
    pcat, mcat = predicted.get("by_category", {}), measured.get("by_category", {})
    errors = {c: (mcat.get(c, 0) - pcat.get(c, 0)) / peak if peak else None for c in sorted(set(pcat) | set(mcat))}
    paths = render_report(run_dir)
    png = paths.get("attribution_timeline")
    if png is not None:
        shutil.copy(png, out / f"{name}_timeline.png")
    row = {
        "model": name, "family": family, "base_config": base or None, "overrides": overrides, "sample": sample,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
        "allocated_before_bytes": allocated_before,
        "strategy": w.plan.strategy.label(), "budget_bytes": w.plan.budget_bytes, "step_recorded": measured["step"],
        "predicted_peak_allocated_bytes": peak, "measured_peak_allocated_bytes": measured["peak_allocated_bytes"],
        "allocator_peak_allocated_bytes": measured.get("allocator_peak_allocated_bytes"),
        "allocator_history_peak_allocated_bytes": (measured.get("allocator_history") or {}).get("peak_allocated_bytes"),
        "predicted_by_category_bytes": pcat, "measured_by_category_bytes": mcat,
        "category_error_of_peak": errors,
        "within_3pct": all(e is not None and abs(e) <= 0.03 for e in errors.values()),
        "by_module": _by_module(predicted, measured),
        "predicted_top_tensors": predicted.get("top_tensors"), "measured_top_tensors": measured.get("top_tensors"),
        "predicted_timeline": attr.get("timeline"), "measured_timeline": measured.get("timeline"),
        "allocator_timeline": (measured.get("allocator_history") or {}).get("timeline"),
        "losses": losses, "plan_s": plan_s, "wall_s": time.perf_counter() - t0,
    }
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for one JSON file per model (and runs/, PNGs)")
    parser.add_argument("--models", default=",".join(m[0] for m in MODELS), help="comma-separated subset")
    parser.add_argument("--steps", type=int, default=2, help="steps per model (the second is recorded)")
    parser.add_argument("--budget", default="40GB")
    parser.add_argument("--zoo", default="", help="comma-separated zoo_matrix_gpu.py row ids, at their budgets")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (planning for an H200): a smoke test")
    args = parser.parse_args(argv)
    device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MEMOPT_CACHE_DIR", str(out / "cache"))
    wanted = args.models.split(",") if not args.zoo else []
    zoo_rows = [(row_id, "zoo", "", {}, {}) for row_id in args.zoo.split(",") if row_id]
    failed = 0
    for name, family, base, overrides, sample in MODELS + zoo_rows:
        if name not in wanted and family != "zoo":
            continue
        if device == "cpu" and family != "zoo":  # the configs' own toy sizes: the flow, not the figures
            overrides = {"dim": 64, "layers": 4, "vocab": 512} if not base else {}
            sample = {"batch_size": 2, "image_size": 32} if "image_size" in sample else {
                "batch_size": 2, "seq_len": 32, **({"decoder_seq_len": 16} if "decoder_seq_len" in sample else {})}
        print(f"[{name}] {family} ...", flush=True)
        try:
            row = run_one(name, family, base, overrides, sample, out, args.steps, device, args.budget)
        except Exception as exc:  # one model's failure must not cost the others' rows
            failed += 1
            row = {"model": name, "family": family, "error": f"{type(exc).__name__}: {exc}",
                   "traceback": traceback.format_exc()}
        (out / f"{name}.json").write_text(json.dumps(row, indent=1, default=str))
        summary = row.get("error") or (f"{row['strategy']}: predicted {row['predicted_peak_allocated_bytes']} B, "
                                       f"measured {row['measured_peak_allocated_bytes']} B, within 3%: "
                                       f"{row['within_3pct']}, {row['wall_s']:.0f} s")
        print(f"[{name}] {summary}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
