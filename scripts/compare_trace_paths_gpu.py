"""On a GPU machine: do the two trace paths agree, and where not, which allocations differ? (issue 18, class 10)

For each case the same model and strategy are profiled and estimated twice, on fake CUDA tensors (the path a
GPU user gets) and on CPU fake tensors with CUDA emulated (the path CI tests), then trained for real under the
strategy for the measured allocated peak. Where the two whole-step simulations differ, the allocations alive at
each path's peak are grouped by the op that made them, so the difference points at its cause. A T5 step with
memopt's checkpointing under bf16 autocast runs with checkpoint debugging on (issue 18, class 3): its error, if
any, names the recomputed tensors and the ops around them.

    python scripts/compare_trace_paths_gpu.py --out benchmarks/trace_paths/h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

import memopt
from memopt.models import SampleSpec, build_model, make_batch
from memopt.profile.cuda_semantics import kernel_policy_for
from memopt.strategy import Checkpointing, Strategy


class Block(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.up = nn.Linear(h, 4 * h)
        self.down = nn.Linear(4 * h, h)
        self.norm = nn.LayerNorm(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class TiedResidualMLP(nn.Module):
    """The issue's custom model: tied embedding and head around a stack of residual MLP blocks."""

    def __init__(self, vocab: int = 32000, h: int = 2048, blocks: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, h)
        self.blocks = nn.ModuleList(Block(h) for _ in range(blocks))
        self.head = nn.Linear(h, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids)
        for b in self.blocks:
            h = b(h)
        logits = self.head(h)
        return {"loss": nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())}


@contextlib.contextmanager
def emulated_path():
    """Trace CPU fake tensors with CUDA emulated, as on a machine without a GPU."""
    import memopt.profile.simulate as simulate
    import memopt.profile.trace as trace

    saved = simulate.trace_device, trace.trace_device
    simulate.trace_device = trace.trace_device = lambda policy: ("cpu", True)
    try:
        yield
    finally:
        simulate.trace_device, trace.trace_device = saved


def _live_at_peak(run: Any) -> Counter:
    """Bytes alive at the run's peak, by the op that allocated them."""
    from memopt.profile.tracker import ALLOC
    from memopt.units import allocator_size

    _peak, at = run.peak()
    live: dict[int, tuple[int, str]] = {}
    for i, (kind, key, size, _phase, label) in enumerate(run.events):
        if kind == ALLOC:
            live[key] = (allocator_size(size), run.labels[label])
        else:
            live.pop(key, None)
        if i == at:
            break
    out: Counter = Counter()
    for size, label in live.values():
        out[label] += size
    return out


def _case(name: str, model: nn.Module, batch_fn: Any, sample: Any, strategy: Strategy, hw: Any) -> dict[str, Any]:
    from memopt.profile.simulate import simulate_step

    row: dict[str, Any] = {"case": name, "strategy": strategy.label()}
    policy = kernel_policy_for(hw)
    for path, ctx in (("fake_cuda", contextlib.nullcontext()), ("cpu_emulated", emulated_path())):
        try:
            with ctx:
                prof = memopt.profile(model, sample, hardware=hw, use_cache=False)
                est = memopt.estimate(prof, strategy, num_steps=3)
                sim = simulate_step(model, batch_fn, strategy, policy=policy, num_steps=3)
            row[path] = {"estimate_peak_allocated": est.peak_allocated_bytes,
                         "simulated_peak_allocated": sim.peak_allocated_bytes, "emulated": sim.emulated,
                         "live_at_peak_by_op": dict(_live_at_peak(sim.run).most_common(25))}
        except Exception as exc:
            row[path] = {"error": f"{type(exc).__name__}: {exc}"[:3000], "traceback": traceback.format_exc()[-4000:]}
    return row


def _measure(model: nn.Module, batch: dict[str, Any], strategy: Strategy) -> dict[str, Any]:
    from memopt.step.prepare import prepare

    model = model.cuda()
    batch = {k: v.cuda() for k, v in batch.items()}
    prepared = prepare(model, strategy, device_type="cuda", device="cuda")
    try:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(3):
            prepared.step.step(batch)
        torch.cuda.synchronize()
        return {"measured_peak_allocated": torch.cuda.max_memory_allocated()}
    except Exception as exc:
        return {"measure_error": f"{type(exc).__name__}: {exc}"[:3000]}
    finally:
        prepared.undo()
        model.cpu()
        torch.cuda.empty_cache()


def t5_checkpoint_debug() -> dict[str, Any]:
    """memopt's checkpointing on T5 under bf16 autocast, with the checkpoint's debug trace on."""
    from torch.utils.checkpoint import set_checkpoint_debug_enabled

    from memopt.step.prepare import prepare

    out: dict[str, Any] = {}
    for mode in ("full", "selective"):
        torch.manual_seed(0)
        model = build_model("t5_base", device="cuda", overrides={"num_layers": 4})
        batch = make_batch("t5_base", {"batch_size": 4, "seq_len": 128, "decoder_seq_len": 32}, device="cuda")
        strategy = Strategy(precision="bf16_autocast", checkpointing=Checkpointing(mode=mode), optimizer="adamw",
                            micro_batch_size=2, grad_accum_steps=2)
        prepared = prepare(model, strategy, device_type="cuda", device="cuda")
        try:
            with set_checkpoint_debug_enabled(True):
                losses = [float(prepared.step.step(batch)) for _ in range(2)]
            out[mode] = {"ok": True, "losses": losses}
        except Exception as exc:
            out[mode] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:20000]}
        finally:
            prepared.undo()
        del model
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/trace_paths/h200.json")
    args = parser.parse_args()
    hw = memopt.load_hardware("auto") if hasattr(memopt, "load_hardware") else "h200"
    rows = []
    mlp = TiedResidualMLP()
    ids = torch.randint(0, 32000, (4, 1024))
    mlp_batch = {"input_ids": ids, "labels": ids.clone()}
    mlp_strategy = Strategy(precision="bf16_autocast", micro_batch_size=4, grad_accum_steps=1,
                            checkpointing=Checkpointing(mode="full", num_blocks=12))
    row = _case("tied_residual_mlp", mlp, lambda d: {k: v.to(d) for k, v in mlp_batch.items()}, mlp_batch,
                mlp_strategy, hw)
    row.update(_measure(mlp, mlp_batch, mlp_strategy))
    rows.append(row)
    for spec, sample in (("tiny_llama", {"batch_size": 4, "seq_len": 256}),
                         ("tiny_gpt2", {"batch_size": 4, "seq_len": 256}),
                         ("tiny_moe", {"batch_size": 4, "seq_len": 256})):
        model = build_model(spec, device="cpu")
        parsed = SampleSpec.parse(sample, spec)
        for strategy in (Strategy(precision="bf16_autocast", micro_batch_size=2, grad_accum_steps=2),
                         Strategy(precision="bf16_autocast", micro_batch_size=2, grad_accum_steps=2,
                                  checkpointing=Checkpointing(mode="full", num_blocks=1))):
            row = _case(spec, model, lambda d, spec=spec, parsed=parsed: make_batch(spec, parsed, device=d),
                        sample, strategy, hw)
            row.update(_measure(model, make_batch(spec, parsed), strategy))
            rows.append(row)
    result = {"rows": rows, "t5_checkpointing": t5_checkpoint_debug(), "torch": torch.__version__,
              "device": torch.cuda.get_device_name(0)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for r in rows:
        print(r["case"], r["strategy"], {k: (v.get("estimate_peak_allocated"), v.get("simulated_peak_allocated"),
                                            v.get("error", "")[:80]) for k, v in r.items() if isinstance(v, dict)},
              r.get("measured_peak_allocated"))
    print("t5:", {k: v.get("ok") for k, v in result["t5_checkpointing"].items()})


if __name__ == "__main__":
    main()
