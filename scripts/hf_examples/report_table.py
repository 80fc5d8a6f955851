"""A readable table of ``run_examples.py``'s results."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

__all__ = ["write_table"]


def _step_time(run: dict[str, Any]) -> str:
    times = [s["seconds"] for s in (run.get("steps") or [])][1:]  # the first step warms up
    return f"{statistics.median(times) * 1000:.0f} ms" if times else "-"


def _peak(run: dict[str, Any]) -> str:
    peaks = [s.get("max_allocated_bytes") for s in (run.get("steps") or []) if s.get("max_allocated_bytes")]
    return f"{max(peaks) / 2**30:.2f} GiB" if peaks else "-"


def _losses(run: dict[str, Any]) -> str:
    losses = [r["loss"] for r in (run.get("losses") or [])]
    return f"{losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "-"


def _plan(run: dict[str, Any]) -> str:
    s = run.get("strategy")
    if not s:
        t = run.get("trainer")
        if not t:
            return "-"
        precision = "bf16" if t["bf16"] else "fp16" if t["fp16"] else "fp32"
        batch = f"{t['gradient_accumulation_steps']}x{t['per_device_train_batch_size']}"
        ckpt = ", HF gradient checkpointing" if t["gradient_checkpointing"] else ""
        return f"(script) {precision}, {batch}, {t['optim']}{ckpt}"
    c = s["checkpointing"]
    ckpt = c["mode"] if c.get("num_blocks") is None else f"{c['mode']}[{c['num_blocks']}]"
    return (f"{s['precision']}, {s['grad_accum_steps']}x{s['micro_batch_size']}, ckpt {ckpt}, {s['optimizer']}, "
            f"expandable={s['expandable_segments']}")


def _applied(run: dict[str, Any]) -> str:
    applied = run.get("applied")
    if not applied:
        return ""
    if "checks" not in applied:
        return f"no: {applied.get('why')}"
    bad = [k for k, v in applied["checks"].items() if v["ok"] is False]
    unseen = [k for k, v in applied["checks"].items() if v["ok"] is None]
    text = "all" if not bad else "NOT " + ", ".join(bad)
    text += f" (not seen here: {', '.join(unseen)})" if unseen else ""
    for r in applied.get("replans", []):
        text += f"; RE-PLANNED at step {r['step']} (out of memory) to {r['to']}"
    return text


def write_table(results: dict[str, Any], path: Path) -> None:
    lines = [f"# transformers example scripts with and without memopt ({results['size']}, {results['device']})", "",
             "Budget and the script's per-device batch (no accumulation): "
             + ", ".join(f"{n} {e.get('budget', results['budget'])} / {e.get('batch', results['batch'])}"
                         for n, e in results["examples"].items())
             + f"; planned for {results['hardware']}; {results['steps']} steps; "
             f"transformers {results.get('transformers_installed')}. The plain run "
             f"{'is capped at the same budget' if results['device'] != 'cpu' else 'runs uncapped (a CPU)'}.", "",
             "Reproduce: " + ", ".join(sorted({f"`{e.get('command', results['command'])}`"
                                                for e in results["examples"].values()})), "",
             "| example | run | ok | configuration (plan or script) | applied as planned | median step | "
             "loss first -> last | peak allocated |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, entry in results["examples"].items():
        for variant, run in entry["runs"].items():
            ok = "yes" if run.get("ok") else f"no ({'OOM' if run.get('oom') else run.get('error', '')[:80]})"
            lines.append(f"| {name} | {variant} | {ok} | {_plan(run)} | {_applied(run)} | {_step_time(run)} | "
                         f"{_losses(run)} | {_peak(run)} |")
    lines += ["", "Losses of memopt's runs against the run whose arithmetic the plan reproduces:", "",
              "| example | comparison | max relative difference | tolerance | equal |",
              "| --- | --- | --- | --- | --- |"]
    for name, entry in results["examples"].items():
        for label, cmp in entry.get("exact", {}).items():
            diff = f"{cmp['max_rel_diff']:.2e}" if "max_rel_diff" in cmp else cmp.get("why", "-")
            lines.append(f"| {name} | {label} | {diff} | {cmp['tolerance']:g} | {'yes' if cmp['equal'] else 'NO'} |")
    path.write_text("\n".join(lines) + "\n")
