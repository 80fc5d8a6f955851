"""How fast this machine's host issues GPU work, relative to the host the clock was fitted on.

The clock's host constants (``memopt.estimate.timing.TimingModel``: ``dispatch_s`` and its kin, host seconds per
op) are fitted on one machine, and the host's speed varies between machines with the same GPU: one host-bound
plan of a 350M model took 0.54 s a step on one H100 host and 0.85 s on another, while GPU-bound plans agreed
within 3% (``benchmarks/plan_quality/h100_s39``). A clock fitted on one host cannot predict a host-bound plan on
another to 10%, so :func:`host_scale` measures the local host: a small eager training step (a few transformer
blocks at sizes the GPU finishes faster than the host issues them) whose host seconds per kernel-launching op,
divided by the same figure on the fitted host (``REFERENCE_OP_S``), scales the clock's host constants
(``HardwareSpec.extra["host_scale"]``, read by ``memopt.estimate.timing.timing_for``).

It runs once per process, on a GPU only, in about 0.3 s, with the RNG states forked so that the user's random
streams are untouched, and its memory given back to the device. It is off unless ``MEMOPT_HOST_PROBE=1``: measured
on one H100 host (``benchmarks/plan_quality/h100_s40``), the probe read 26 to 43 us per op from one process to the
next while the host cost per op of the rows measured in those same processes (RoBERTa, OPT, Swin, T5: 34 to 41 us)
did not follow it, so the scale it gives would add noise to the clock rather than remove the host's part of the
error. ``HardwareSpec.extra["host_scale"]`` (``+hardware.extra.host_scale=1.3`` in a config) sets the scale by hand.
"""

from __future__ import annotations

import math
import os
import time
from functools import cache
from typing import Any

from memopt.kernel_ops import FREE_OPS

__all__ = ["REFERENCE_OP_S", "host_scale", "probe_op_seconds", "scale_for"]

#: the probe's host seconds per kernel-launching op on a host whose rows the fitted constants predict: one H100
#: host read 34.5 us (the median of 8 probes) where its host-bound rows ran 1.15x the fitted host time
REFERENCE_OP_S = 30.0e-6
# the scale moves in steps of 2 ** (1/16), about 4%: a host measured again lands on the same spec, so the on-disk
# memo of estimates (keyed by the whole spec) keeps its entries between runs
_STEPS_PER_OCTAVE = 16
_BOUNDS = (0.25, 4.0)


def _probe_model(device: Any) -> tuple[Any, Any]:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, d: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, d = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
            a = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           is_causal=True)
            x = x + self.out(a.transpose(1, 2).reshape(b, t, d))
            return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))

    class Probe(nn.Module):
        def __init__(self, vocab: int = 128, d: int = 64, layers: int = 4) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(Block(d, 4) for _ in range(layers))
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.embed(ids)
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.norm(x))
            return nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())

    model = Probe().to(device)
    ids = torch.arange(2 * 16, device=device).view(2, 16) % 128
    return model, ids


def probe_op_seconds(device: Any = None, *, iters: int = 8, repeats: int = 3) -> float:
    """Host seconds per kernel-launching op of the probe's training step (forward and backward under bf16
    autocast, gradients dropped) on ``device`` (default: the current CUDA device): the fastest of ``repeats``
    timings of ``iters`` steps, so that a moment of host noise does not count. The RNG states are restored."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    device = torch.device(device or f"cuda:{torch.cuda.current_device()}")

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            if func._overloadpacket.__name__ not in FREE_OPS:
                self.ops += 1
            return func(*args, **(kwargs or {}))

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        best, ops = _time_steps(device, Count, iters, repeats)
    if device.type == "cuda":
        # cuBLAS keeps its workspaces in the caching allocator: held, they would fix the allocator's segment mode
        # before the plan chooses it (measured: every plan of the first probe run fell back to the default mode)
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()  # the probe's few MB back to the device before the plan's allocator settings apply
    return best / (iters * max(ops, 1))


def _time_steps(device: Any, count_mode: Any, iters: int, repeats: int) -> tuple[float, int]:
    """The fastest of ``repeats`` timings of ``iters`` probe steps, and the probe step's kernel-launching ops."""
    import torch

    model, ids = _probe_model(device)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(ids)
        loss.backward()
        for p in model.parameters():
            p.grad = None

    step()  # kernels loaded, allocator warmed
    counter = count_mode()
    with counter:
        step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda _device: None)
    best = math.inf
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        for _ in range(iters):
            step()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best, counter.ops


@cache
def host_scale() -> float:
    """This host's seconds per op over the fitted host's (``REFERENCE_OP_S``), in steps of about 4% and within
    [0.25, 4], measured once per process with ``MEMOPT_HOST_PROBE=1``; 1.0 otherwise or without a GPU."""
    import torch

    if os.environ.get("MEMOPT_HOST_PROBE", "0") != "1" or not torch.cuda.is_available():
        return 1.0
    return scale_for(probe_op_seconds())


def scale_for(op_seconds: float) -> float:
    """The host scale of a probe measurement: ``op_seconds / REFERENCE_OP_S`` in steps of 2 ** (1/16), within
    [0.25, 4] (a host 4x off the fitted one is a measurement gone wrong, not a host)."""
    raw = op_seconds / REFERENCE_OP_S
    stepped = 2.0 ** (round(_STEPS_PER_OCTAVE * math.log2(raw)) / _STEPS_PER_OCTAVE)
    return min(max(stepped, _BOUNDS[0]), _BOUNDS[1])
