"""``step(batch)`` under data parallelism: FSDP2, DDP and DeepSpeed, with exact token-weighted accumulation.

Each rank calls ``step`` with its own share of the global batch (``shard_batch``). Before the first
micro-batch the ranks sum their loss-token counts (one small all-reduce), so micro-batch ``i`` of rank
``r`` with ``n_i`` tokens contributes ``loss_i * n_i / N`` to the gradient, ``N`` being the count of the
whole global batch. The engines average gradients over the ``W`` data-parallel ranks, so the loss that
goes backward is ``loss_i * n_i * W / N``: the reduced gradient is then exactly the gradient of the
global batch's mean loss, whatever the ranks' token counts — as ``memopt.step.train_step.TrainStep`` on
one GPU. The returned loss is the global batch's mean (a second small all-reduce).

FSDP2 reduce-scatters each micro-batch's gradients (the sharded gradients accumulate; keeping unsharded
gradients across micro-batches would cost a full unit's gradients per block). DDP skips the all-reduce
on all but the last micro-batch (``no_sync``).

DeepSpeed: its engine owns accumulation. ``engine.backward(loss, scale_wrt_gas=False)`` takes the same
``loss_i * n_i * W / N`` (DeepSpeed's own ``1 / gradient_accumulation_steps`` scaling is turned off) and
``engine.step()`` runs after every micro-batch (it updates at the accumulation boundary). What the
engine decides and memopt cannot: the number of micro-batches per step is fixed in its config
(``gradient_accumulation_steps``, checked here); with bf16 at ZeRO-2/3 the gradients accumulate across
micro-batches in bf16 (memopt's single-GPU ``bf16_autocast`` accumulates in fp32); clipping
(``gradient_clipping``), the fp16 loss scale (which may skip steps) and the LR scheduler are the
engine's; the model runs in the engine's 16-bit weights, without autocast.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from memopt.step import batch as _batch
from memopt.step.batch_samples import batch_size
from memopt.step.loss_items import NUM_ITEMS
from memopt.step.loss_reduction import (
    classify_reduction,
    first_labelled,
    micro_batch_weights,
    reduction_sample,
    settle,
)
from memopt.step.train_step import TrainStep, discard_accumulation, loss_item_counts, micro_batch_to, split_batch
from memopt.techniques.attention import sdpa_restricted

__all__ = ["DistributedTrainStep", "shard_batch"]

_VERDICTS = ("mean", "sum", "coupled", "masked")


def shard_batch(batch: Any, rank: int, world_size: int) -> Any:
    """Rank ``rank``'s contiguous share of a global batch (samples along dim 0, divisible by ``world_size``; any
    batch structure of ``memopt.step.batch``)."""
    return _batch.shard(batch, rank, world_size)


def _labelled_stand_ins(micro: list[Any], counts: list[int], weights: list[float]) -> list[Any]:
    """The micro-batches a rank runs. Every rank must run each of its micro-batches' forward and backward (the
    engines' gathers and reductions are in them), but one without a labelled item has a loss of 0/0: its weight of 0
    does not cancel that (a masked mean's backward divides by the zero count, and the reported loss is NaN either
    way). One process skips it (``TrainStep.step``); a rank runs a labelled micro-batch of its own in its place, at
    the same weight 0: the same shapes and collectives, gradients and loss unchanged. A rank none of whose
    micro-batches is labelled runs them as they are."""
    labelled = first_labelled(micro, counts)
    if labelled is None:
        return micro
    return [labelled if n == 0 and w == 0 else mb for mb, n, w in zip(micro, counts, weights)]


@dataclass
class DistributedTrainStep(TrainStep):
    """``TrainStep`` for a model under FSDP2 / DDP, or a DeepSpeed engine (``engine``).

    ``group``: the data-parallel process group (default: the world); ``world_size``: its size (read from
    the group when 0). ``samples_seen`` counts the global batch's samples over all steps (the data position a
    checkpoint keeps).
    """

    engine: Any = None
    group: Any = None
    world_size: int = 0
    samples_seen: int = 0
    kind: str = "fsdp2"  # "fsdp2", "ddp" or "deepspeed"
    engine_precision: bool = True  # the engine casts (FSDP2 MixedPrecisionPolicy): no autocast around forward

    def __post_init__(self) -> None:
        import torch.distributed as dist

        if self.engine is not None:
            self.kind = "deepspeed"
        if not self.world_size:
            self.world_size = dist.get_world_size(self.group) if dist.is_initialized() else 1

    @contextlib.contextmanager
    def _forward_ctx(self) -> Iterator[None]:
        if self.engine_precision:
            with sdpa_restricted(self.strategy.attention):
                yield
        else:
            with super()._forward_ctx():
                yield

    def _device(self) -> torch.device:
        if self.device is not None:
            return torch.device(self.device)
        p = next(self.model.parameters(), None)
        if p is not None and p.device.type != "meta":
            return torch.device("cpu") if p.device.type == "cpu" else p.device
        return torch.device("cpu")

    def _all_reduce(self, values: list[float]) -> list[float]:
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        if dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(t, group=self.group)
        return t.tolist()

    def _comm_device(self) -> torch.device:
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def step(self, batch: Any) -> float:
        """One optimizer step over this rank's share of the global batch; returns the global mean loss. Starts from
        no gradient on the parameters it trains, as the one-GPU step (what another loss left there is not this
        batch's); DeepSpeed's engine keeps its own gradient buffers and clears them itself."""
        if self.kind != "deepspeed":
            self.clear_grads()
        micro = split_batch(batch, self.strategy.micro_batch_size)
        if isinstance(batch, Mapping) and NUM_ITEMS in batch and len(micro) * self.world_size > 1:
            # each rank would divide by the same count and then be weighted again by its labels
            raise ValueError(f"a batch carrying {NUM_ITEMS} cannot be split over micro-batches and ranks exactly: "
                             f"leave {NUM_ITEMS} out of the batch (memopt weighs each part by its own labels)")
        counts = loss_item_counts(micro, self.causal_lm)
        samples = batch_size(batch)
        total_items, total_samples = self._all_reduce([float(sum(counts)), float(samples)])
        if total_items == 0:
            raise ValueError("the global batch has no tokens that carry loss (every label is -100)")
        weights = micro_batch_weights(counts, self._agreed_reduction(micro, counts), self.world_size,
                                      total=total_items)
        runs = _labelled_stand_ins(micro, counts, weights)
        local = (self._deepspeed_step if self.kind == "deepspeed" else self._local_step)(runs, weights)
        (mean,) = self._all_reduce([local])
        self.samples_seen += int(total_samples)
        return mean

    def _agreed_reduction(self, micro: list[Any], counts: list[int]) -> str:
        """"mean" or "sum". Under "auto", measured the first time the global batch is split (over micro-batches or
        ranks) on each rank's first micro-batch that carries loss items (a loss of none is 0/0), and agreed over the
        ranks, so that every rank raises or none does."""
        if self.reduction is None:
            return "mean"
        if self.reduction.mode == "auto" and len(micro) * self.world_size > 1:
            # DeepSpeed's engine runs its own mixed precision (its step calls it without autocast, and it warns of one)
            model, precision = (self.engine, "fp32") if self.engine is not None else (self.model,
                                                                                     self.strategy.precision)
            first = reduction_sample(micro, counts, causal=self.causal_lm)
            verdict, why = classify_reduction(model, micro_batch_to(first, self.device), self.loss_fn,
                                              precision=precision, device_type=self.device_type,
                                              causal=self.causal_lm)
            votes = self._all_reduce([float(verdict == v) for v in _VERDICTS])
            agreed = dict(zip(_VERDICTS, votes))
            if agreed["coupled"] and verdict != "coupled":
                verdict, why = "coupled", "another rank's check measured it"
            elif agreed["masked"] and verdict != "masked":
                verdict, why = "masked", "another rank's check measured it"
            elif agreed["mean"] and agreed["sum"]:
                verdict, why = "coupled", "the ranks' checks found a mean on some ranks and a sum on others"
            elif agreed["sum"] or agreed["mean"]:  # a rank that could not tell follows the others
                verdict = "sum" if agreed["sum"] else "mean"
            self.reduction.mode = settle(verdict, why)
        return "mean" if self.reduction.mode == "auto" else self.reduction.mode

    def _local_step(self, micro: list[Any], weights: list[float]) -> float:
        w = self.world_size
        local = 0.0
        self.last_micro_losses = []
        last = len(micro) - 1
        try:
            for i, (mb, weight) in enumerate(zip(micro, weights)):
                sync: Any = contextlib.nullcontext()
                if self.kind == "ddp" and i < last and hasattr(self.model, "no_sync"):
                    sync = self.model.no_sync()
                with sync:
                    self._phase(f"forward[{i}]")
                    loss = self.loss(micro_batch_to(mb, self.device))
                    self._phase(f"backward[{i}]")
                    self.backward(loss * weight)
                if weight:  # a micro-batch without labelled items adds nothing (``_labelled_stand_ins``)
                    value = float(loss.detach())
                    self.last_micro_losses.append(value)
                    local += value * weight / w
                del loss
        except BaseException:
            discard_accumulation(self)  # as the one-GPU step: a step that did not finish leaves no gradients
            raise
        self.optimizer_step()
        return local

    def _deepspeed_step(self, micro: list[Any], weights: list[float]) -> float:
        engine = self.engine
        gas = engine.gradient_accumulation_steps()
        if len(micro) != gas:
            raise ValueError(f"the DeepSpeed engine accumulates {gas} micro-batches per step (its config's "
                             f"gradient_accumulation_steps) but this batch splits into {len(micro)}; pass "
                             f"{gas * self.strategy.micro_batch_size} samples per rank")
        w = self.world_size
        local = 0.0
        self.last_micro_losses = []
        device = engine.device if hasattr(engine, "device") else self.device
        for i, (mb, weight) in enumerate(zip(micro, weights)):
            self._phase(f"forward[{i}]")
            # the engine's forward by the batch contract; its output (a language model's logits: 1.05 GB at 2 x 2048
            # tokens of Llama-3.2-1B) is not needed by backward and is dropped inside compute_loss: held through
            # backward, it sat on the peak (measured on the H200, raw/session8_call2)
            with sdpa_restricted(self.strategy.attention):
                loss = _batch.compute_loss(engine, micro_batch_to(mb, device), self.loss_fn)
            self._phase(f"backward[{i}]")
            with sdpa_restricted(self.strategy.attention):
                engine.backward(loss * weight, scale_wrt_gas=False)
            engine.step()
            if weight:  # a micro-batch without labelled items adds nothing (``_labelled_stand_ins``)
                value = float(loss.detach().float())
                self.last_micro_losses.append(value)
                local += value * weight / w
            del loss
        self.steps_done += 1
        return local

