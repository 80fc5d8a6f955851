"""Process bodies for the gloo tests (imported by spawned processes: keep importable and light)."""

from __future__ import annotations

import functools
import gc
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memopt.strategy import Strategy

VOCAB, DIM, BLOCKS, SEQ, GLOBAL_BATCH = 64, 32, 3, 8, 8


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class TinyLM(nn.Module):
    """Embedding, a stack of MLP blocks, a head; returns {"loss": mean CE over labels != -100}."""

    def __init__(self, vocab: int = VOCAB, d: int = DIM, n: int = BLOCKS) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([Block(d) for _ in range(n)])
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        h = self.emb(input_ids)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(h)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                          ignore_index=-100)
        return out


def tiny_model(seed: int = 0, dims: tuple[int, int, int] | list[int] | None = None) -> TinyLM:
    """``TinyLM`` (``dims``: its ``(vocab, d, n)``, default ``(VOCAB, DIM, BLOCKS)``) with seeded weights."""
    torch.manual_seed(seed)
    return TinyLM(*dims) if dims else TinyLM()


def unit_sizes(model: TinyLM) -> tuple[list[int], int]:
    units = [sum(p.numel() for p in b.parameters()) for b in model.layers]
    root = sum(p.numel() for p in model.parameters()) - sum(units)
    return units, root


def global_batch(position: int, size: int = GLOBAL_BATCH) -> dict[str, torch.Tensor]:
    """Samples ``position .. position + size`` of an endless deterministic data set; labels are masked
    unevenly so that ranks and micro-batches carry different token counts."""
    ids, labels = [], []
    for i in range(position, position + size):
        g = torch.Generator().manual_seed(1000 + i)
        x = torch.randint(0, VOCAB, (SEQ,), generator=g)
        y = torch.roll(x, -1)
        y[: i % 5] = -100
        ids.append(x)
        labels.append(y)
    return {"input_ids": torch.stack(ids), "labels": torch.stack(labels)}


def reference_losses(steps: int, micro_batch: int = 2, lr: float = 1e-2) -> list[float]:
    """The single-process trajectory: memopt's TrainStep on one device over the whole global batch."""
    from memopt.step.train_step import TrainStep

    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    strategy = Strategy(precision="fp32", micro_batch_size=micro_batch, grad_accum_steps=GLOBAL_BATCH // micro_batch)
    step = TrainStep(model=model, optimizer=opt, strategy=strategy, device_type="cpu")
    return [step.step(global_batch(s * GLOBAL_BATCH)) for s in range(steps)]


def summed_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A user's training_step whose loss is summed over the batch's tokens, not averaged."""
    logits = model(input_ids=batch["input_ids"])["logits"]
    return F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(), reduction="sum")


def _unwrapped_loop(loss_of: Callable[..., torch.Tensor], batch_at: Callable[[int], Any], steps: int,
                    lr: float) -> tuple[list[float], nn.Module]:
    """The unwrapped loop over the whole global batch: ``loss_of(model, batch)``, AdamW; its losses and model."""
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for s in range(steps):
        loss = loss_of(model, batch_at(s * GLOBAL_BATCH))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, model


def summed_reference(steps: int, lr: float = 1e-2) -> list[float]:
    """The unwrapped loop over the whole global batch with ``summed_loss``."""
    return _unwrapped_loop(summed_loss, global_batch, steps, lr)[0]


def masked_mean_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A user's training_step averaging over the labelled tokens by hand: over none, it is 0/0."""
    logits = model(input_ids=batch["input_ids"])["logits"].float()
    labels = batch["labels"].flatten()
    mask = (labels != -100).float()
    ce = F.cross_entropy(logits.flatten(0, 1), labels.clamp(min=0), reduction="none")
    return (ce * mask).sum() / mask.sum()


def batch_with_an_unlabelled_micro_batch(position: int) -> dict[str, torch.Tensor]:
    """``global_batch`` whose first two samples (rank 0's first micro-batch of 2) carry no labelled token."""
    batch = global_batch(position)
    batch["labels"][:2] = -100
    return batch


def masked_mean_reference(steps: int, lr: float = 1e-2) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The unwrapped loop over the whole global batch with ``masked_mean_loss``: losses and trained parameters."""
    losses, model = _unwrapped_loop(masked_mean_loss, batch_with_an_unlabelled_micro_batch, steps, lr)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _init(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _in_group(body: Callable[..., None]) -> Callable[..., None]:
    """A spawned rank's body, run between joining the gloo group and leaving it with its peers. The body returns
    before the group is destroyed, so what it made (FSDP's pending work handles hold tensors) is freed while the
    interpreter is whole: freed at interpreter exit instead, a gloo work object's tensors take the GIL of a
    finalizing interpreter and the rank aborts with "terminate called without an active exception" (seen in CI).
    The barrier is skipped on an error, where the peer may never reach it and mp.spawn reports the failure."""

    @functools.wraps(body)
    def rank_main(rank: int, world: int, port: int, *args: Any) -> None:
        _init(rank, world, port)
        run_then_leave_group(body, rank, world, port, *args)

    return rank_main


def run_then_leave_group(body: Callable[..., None], *args: Any) -> None:
    """``body(*args)`` in a joined gloo group, then the group left with its peers (see :func:`_in_group`)."""
    import torch.distributed as dist

    try:
        body(*args)
    except BaseException:
        dist.destroy_process_group()
        raise
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def _fsdp_step(rank: int, world: int, *, offload: bool = False, micro_batch: int = 2, lr: float = 1e-2,
               model: nn.Module | None = None, **step_kw: Any) -> Any:
    from memopt.distributed.torch_engines import apply_fsdp2
    from memopt.distributed.train_step import DistributedTrainStep
    from memopt.techniques.sharding import ShardingSetting

    model = model if model is not None else tiny_model()
    setting = ShardingSetting(engine="fsdp2", world_size=world, offload_optimizer="cpu" if offload else "none",
                              offload_params="cpu" if offload else "none", pin_memory=False)
    undo = apply_fsdp2(model, setting, None, [list(model.layers)], device_type="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    per_rank = GLOBAL_BATCH // world
    strategy = Strategy(precision="fp32", micro_batch_size=micro_batch, grad_accum_steps=per_rank // micro_batch)
    step = DistributedTrainStep(model=model, optimizer=opt, strategy=strategy, device_type="cpu", **step_kw)
    return model, opt, step, undo


@_in_group
def fsdp_summed_trajectory(rank: int, world: int, port: int, out: str, steps: int) -> None:
    """FSDP2 on ``world`` gloo ranks with ``summed_loss`` under loss_reduction "auto"; rank 0 writes the losses."""
    from memopt.distributed.train_step import shard_batch
    from memopt.step.batch import TrainingStep
    from memopt.step.loss_reduction import LossReduction

    reduction = LossReduction("auto")
    _, _, step, undo = _fsdp_step(rank, world, loss_fn=TrainingStep(summed_loss), reduction=reduction)
    losses = [step.step(shard_batch(global_batch(s * GLOBAL_BATCH), rank, world)) for s in range(steps)]
    undo()
    if rank == 0:
        Path(out).write_text(json.dumps({"losses": losses, "reduction": reduction.mode}))


@_in_group
def fsdp_unlabelled_micro_batch_trajectory(rank: int, world: int, port: int, out: str, steps: int) -> None:
    """FSDP2 on ``world`` gloo ranks with ``masked_mean_loss``, rank 0's first micro-batch unlabelled every step;
    rank 0 writes the losses and the trained parameters."""
    from memopt.distributed.train_step import shard_batch
    from memopt.step.batch import TrainingStep

    model, _, step, undo = _fsdp_step(rank, world, loss_fn=TrainingStep(masked_mean_loss))
    losses = [step.step(shard_batch(batch_with_an_unlabelled_micro_batch(s * GLOBAL_BATCH), rank, world))
              for s in range(steps)]
    undo()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    if rank == 0:
        Path(out).write_text(json.dumps({"losses": losses}))
        torch.save(full, out + ".params.pt")


@_in_group
def fsdp_trajectory(rank: int, world: int, port: int, out: str, steps: int, offload: bool) -> None:
    """Train ``steps`` steps with FSDP2 on ``world`` gloo ranks; rank 0 writes losses and (offload) traffic."""

    from memopt.distributed.train_step import shard_batch

    model, opt, step, undo = _fsdp_step(rank, world, offload=offload)
    counter = _TrafficCounter() if offload else None
    losses, traffic = [], []
    for s in range(steps):
        batch = shard_batch(global_batch(s * GLOBAL_BATCH), rank, world)
        if counter is not None:
            counter.reset()
            with counter:
                losses.append(step.step(batch))
            traffic.append(dict(counter.bytes))
        else:
            losses.append(step.step(batch))
    devices = sorted({str(p.to_local().device) for p in model.parameters()})
    local_param_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    opt_bytes = sum(_local(t).numel() * t.element_size() for st in opt.state.values() for t in st.values()
                    if isinstance(t, torch.Tensor) and t.dim() > 0)
    opt_devices = sorted({str(_local(t).device) for st in opt.state.values() for t in st.values()
                          if isinstance(t, torch.Tensor)})
    undo()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    is_plain = all(type(p) is nn.Parameter for p in model.parameters()) and type(model) is TinyLM
    if rank == 0:
        result = {"losses": losses, "traffic": traffic, "devices": devices, "local_param_bytes": local_param_bytes,
                  "opt_bytes": opt_bytes, "opt_devices": opt_devices, "undo_plain": is_plain,
                  "micro_batches": step.strategy.grad_accum_steps, "samples_seen": step.samples_seen}
        Path(out).write_text(json.dumps(result))
        torch.save(full, out + ".params.pt")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class _TrafficCounter:
    """Counts the bytes FSDP2 moves between host and device at its offload copy points.

    FSDP2 calls ``Tensor.to(device)`` on a parameter shard before its all-gather (``_fsdp_param.py``) and
    ``Tensor.to("cpu")`` on a gradient shard after its reduce-scatter (``_fsdp_collectives.py``). On a GPU
    those are the PCIe copies; on the CPU they return the same tensor, so the calls are counted instead.
    """

    def __init__(self) -> None:
        self.bytes = {"h2d_bytes": 0, "d2h_bytes": 0}
        self._orig = torch.Tensor.to

    def reset(self) -> None:
        self.bytes = {"h2d_bytes": 0, "d2h_bytes": 0}

    def __enter__(self) -> _TrafficCounter:
        counter, orig = self, self._orig

        def to(t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            caller = sys._getframe(1).f_code.co_filename
            if caller.endswith(("_fsdp_param.py", "_fsdp_collectives.py")):
                key = "h2d_bytes" if caller.endswith("_fsdp_param.py") else "d2h_bytes"
                counter.bytes[key] += t.numel() * t.element_size()
            return orig(t, *args, **kwargs)

        torch.Tensor.to = to  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.Tensor.to = self._orig  # type: ignore[method-assign]


class AioTraffic:
    """Counts the bytes DeepSpeed's async I/O handles read from and write to the swap files (ZeRO-Infinity).

    DeepSpeed's swappers create their handles from ``AsyncIOBuilder().load().aio_handle`` (the op module is loaded
    once); this swaps that class for a wrapper that adds each request's tensor bytes before passing it on, so it must
    be entered before ``deepspeed.initialize``. ``close`` restores the class.
    """

    READS = ("async_pread", "sync_pread", "pread")
    WRITES = ("async_pwrite", "sync_pwrite", "pwrite")

    def __init__(self) -> None:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        self.bytes = {"read_bytes": 0, "write_bytes": 0, "reads": 0, "writes": 0}
        self._op = AsyncIOBuilder().load(verbose=False)
        self._real = real = self._op.aio_handle
        counter = self

        class Handle:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                self._h = real(*args, **kwargs)

            def __getattr__(self, name: str) -> Any:
                attr = getattr(self._h, name)
                if name not in AioTraffic.READS + AioTraffic.WRITES:
                    return attr
                kind = "read" if name in AioTraffic.READS else "write"

                def counted(buffer: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                    counter.bytes[f"{kind}_bytes"] += buffer.numel() * buffer.element_size()
                    counter.bytes[f"{kind}s"] += 1
                    return attr(buffer, *args, **kwargs)

                return counted

        self._op.aio_handle = Handle

    def close(self) -> None:
        self._op.aio_handle = self._real


@_in_group
def fsdp_checkpoint(rank: int, world: int, port: int, out: str, ckpt: str, steps: int) -> None:
    """Train ``steps`` steps at ``world`` ranks, save, train one more step and write its loss."""

    from memopt.distributed.checkpoint import save_checkpoint
    from memopt.distributed.train_step import shard_batch

    model, opt, step, _ = _fsdp_step(rank, world)
    for _ in range(steps):
        step.step(shard_batch(global_batch(step.samples_seen), rank, world))
    save_checkpoint(ckpt, model, opt, step)
    next_loss = step.step(shard_batch(global_batch(step.samples_seen), rank, world))
    if rank == 0:
        Path(out).write_text(json.dumps({"next_loss": next_loss, "steps_done": step.steps_done,
                                         "samples_seen": step.samples_seen}))


class BigBlocks(nn.Module):
    """A model of ``n`` square linear layers (for the sharded-loading memory test)."""

    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d, d, bias=False) for _ in range(n)])
        self.register_buffer("scale", torch.ones(d), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x * self.scale


@_in_group
def load_sharded_worker(rank: int, world: int, port: int, out: str, path: str, d: int, n: int) -> None:
    """Fill a meta model's FSDP2 shards from ``path``; record RSS growth and check the shard values."""
    import resource

    import psutil
    from safetensors import safe_open

    from memopt.distributed.checkpoint import load_sharded

    proc = psutil.Process()
    with torch.device("meta"):
        model = BigBlocks(d, n)
    model.scale = torch.full((d,), 2.0)  # a real buffer, as accelerate's init_empty_weights keeps them
    import gc
    import importlib

    # imported before the baseline: their code is not the model
    for name in ("torch.distributed.fsdp", "torch.distributed.tensor", "memopt.distributed.torch_engines"):
        importlib.import_module(name)

    gc.collect()
    rss_before = proc.memory_info().rss
    max_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    load_sharded(model, [path], {"engine": "fsdp2", "world_size": world})
    gc.collect()
    rss_after = proc.memory_info().rss
    max_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ok = True
    with safe_open(path, framework="pt") as f:
        for name, p in model.named_parameters():
            local = p.to_local()
            rows = local.shape[0]
            expect = f.get_slice(name)[rank * rows:(rank + 1) * rows]
            ok = ok and torch.equal(local, expect)
    local_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    buffer_kept = bool(torch.equal(model.scale, torch.full((d,), 2.0)))
    Path(f"{out}.{rank}").write_text(json.dumps({
        "rss_growth": rss_after - rss_before, "peak_growth": max(0, max_after - max(max_before, rss_before)),
        "max_after_minus_rss_before": max_after - rss_before, "values_ok": ok, "local_bytes": local_bytes,
        "buffer_kept": buffer_kept}))


@_in_group
def wrapped_sharded_trajectory(rank: int, world: int, port: int, out: str, steps: int) -> None:
    """``memopt.wrap(model, plan=...)`` with a two-rank FSDP2 plan, fed the *global* batch on every rank."""

    import memopt
    from memopt.plan.schema import Plan
    from memopt.techniques.sharding import ShardingSetting

    setting = ShardingSetting(engine="fsdp2", world_size=world, pin_memory=False)
    per_rank = GLOBAL_BATCH // world
    strategy = Strategy(precision="fp32", micro_batch_size=2, grad_accum_steps=per_rank // 2,
                        extras=(("sharding", setting.to_dict()),))
    plan = Plan(fits=True, strategy=strategy, budget_bytes=0, margin_bytes=0, prediction={}, model={},
                hardware="cpu", policy={}, global_batch=GLOBAL_BATCH)
    wrapped = memopt.wrap(tiny_model(), plan=plan, lr=1e-2, weight_decay=0.01, device="cpu")
    losses = [wrapped.step(global_batch(s * GLOBAL_BATCH)) for s in range(steps)]
    sharded = all(type(p).__name__ == "DTensor" for p in wrapped.model.parameters())
    if rank == 0:
        Path(out).write_text(json.dumps({"losses": losses, "sharded": sharded,
                                         "samples_seen": wrapped.samples_seen}))
    wrapped.close()
