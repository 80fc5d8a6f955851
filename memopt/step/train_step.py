"""One optimizer step over the user's global batch: micro-batches, exact accumulation, the update.

What a batch may be and how the loss is made: ``memopt.step.batch``.

The same code runs a real training step (``memopt.wrap``) and a simulated one on fake tensors (the
profile's ground truth), so what is measured is what is predicted.

Accumulation is exact: micro-batch ``i`` with ``n_i`` loss tokens (or samples) contributes
``loss_i * n_i / N`` where ``N`` is the global batch's count, so the accumulated gradient equals the
gradient of the whole batch's mean loss; a summed loss contributes ``loss_i``
(``memopt.step.loss_reduction``). Clipping, the scheduler and the step counter advance once per
optimizer step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memopt.step import batch as _batch
from memopt.step.grad_scaling import forget_unscale, grads_unscaled, rescale_
from memopt.step.loss_items import NUM_ITEMS, first_label_decides, measure_label_shift, num_items_normalises
from memopt.step.loss_reduction import (
    LossReduction,
    first_labelled,
    measure_reduction,
    micro_batch_weights,
    reduction_sample,
)
from memopt.step.right_padding import PaddingCut, padding_invariant
from memopt.step.scheduler_watch import SchedulerWatch
from memopt.strategy import Strategy
from memopt.techniques.activation_offload import ActivationOffload
from memopt.techniques.attention import sdpa_restricted
from memopt.techniques.chunked_ce import causal_lm_chunked_loss
from memopt.techniques.precision import MasterWeights, forward_context

__all__ = ["SchedulerStepFailed", "TrainStep", "count_loss_items", "default_loss", "discard_accumulation",
           "loss_item_counts", "split_batch"]

LossFn = Callable[[Any, Any], torch.Tensor]


class SchedulerStepFailed(RuntimeError):
    """The learning-rate scheduler raised after the optimizer step had updated the weights: the step happened and
    is counted (``TrainStep.steps_done``, and ``Wrapped.steps_done`` above it); only the rate did not move."""


def split_batch(batch: Any, micro_batch_size: int) -> list[Any]:
    """Micro-batches of ``micro_batch_size`` samples along dim 0 (any batch structure: ``memopt.step.batch``)."""
    return _batch.split(batch, micro_batch_size)


def count_loss_items(batch: Any, *, causal: bool = False) -> int:
    """Tokens that carry loss (labels != -100), or samples when labels are per-sample. A causal LM predicts
    token i+1 at position i, so the first label of each row carries no loss (``causal=True``)."""
    return _batch.count_loss_items(batch, causal=causal)


def default_loss(output: Any, batch: Any) -> torch.Tensor:
    return _batch.default_loss(output, batch)


def micro_batch_to(batch: Any, device: torch.device | str | None) -> Any:
    """One micro-batch on ``device`` (the distributed steps move theirs one at a time)."""
    return _batch.to_device(batch, device)


def _stage(micro: list[Any], device: torch.device | str | None) -> list[Any]:
    """Every micro-batch on ``device`` at once, before the first forward. Host tensors bound for a GPU are pinned
    first: a copy from pageable memory blocks the host until the GPU has drained its queue, which on every
    micro-batch would stall the kernel launches ahead of it. (The estimate counts the whole global batch on the
    device already.)"""
    if device is None:
        return micro
    return [_batch.to_device(mb, device, pin=True) for mb in micro]


def loss_item_counts(micro: list[Any], causal: bool) -> list[int]:
    """``count_loss_items`` of each micro-batch, with at most one device-to-host sync for all of them: a sync per
    micro-batch would drain the GPU's queue before each one's forward."""
    return _batch.read_back([_batch.count_pending(mb, causal=causal) for mb in micro])


@dataclass
class TrainStep:
    """Runs ``step(batch)`` for a prepared model and optimizer under one strategy."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    strategy: Strategy
    device_type: str
    device: torch.device | str | None = None
    loss_fn: LossFn | None = None
    scaler: Any = None
    master: MasterWeights | None = None
    offload: ActivationOffload | None = None
    max_grad_norm: float | None = None
    lr_scheduler: Any = None
    on_phase: Callable[[str], None] | None = None
    # labels are shifted inside the model: the class's word (Hugging Face *ForCausalLM) until a batch measures it
    # (memopt.step.loss_items)
    causal_lm: bool = False
    # how the loss reduces over samples (memopt.step.loss_reduction); None: a mean, not measured (traces, simulations)
    reduction: LossReduction | None = None
    # trailing padding cut off each micro-batch where measured exact (memopt.step.right_padding); None: never cut
    # (traces and simulations, whose batches are fake)
    padding: PaddingCut | None = None
    steps_done: int = 0
    last_micro_losses: list[float] = field(default_factory=list)
    # lr_scheduler stepped by the script too, between memopt's steps of it: warned of once
    scheduler_watch: SchedulerWatch = field(default_factory=SchedulerWatch)

    def _phase(self, name: str) -> None:
        if self.on_phase is not None:
            self.on_phase(name)

    @contextlib.contextmanager
    def _forward_ctx(self) -> Iterator[None]:
        with sdpa_restricted(self.strategy.attention), forward_context(self.strategy.precision, self.device_type):
            if self.offload is not None:
                with self.offload.hooks():
                    yield
            else:
                yield

    def loss(self, micro_batch: Any) -> torch.Tensor:
        """The forward pass and loss of one micro-batch (under the strategy's autocast), by the batch contract of
        ``memopt.step.batch``; chunked cross-entropy replaces the model's own causal-LM loss."""
        with self._forward_ctx():
            if self.strategy.chunked_ce:
                if isinstance(micro_batch, Mapping):  # a tokenizer's BatchEncoding is the dict it holds
                    micro_batch = dict(micro_batch)
                if self.loss_fn is not None or not isinstance(micro_batch, dict):
                    raise ValueError("chunked cross-entropy replaces the model's own causal-LM loss; with a loss_fn, "
                                     "a training_step or a non-dict batch the loss is yours: plan with chunked_ce=0")
                loss = causal_lm_chunked_loss(self.model, micro_batch, chunks=self.strategy.chunked_ce,
                                              kernel=self.strategy.ce_kernel)
            else:
                loss = _batch.compute_loss(self.model, micro_batch, self.loss_fn)
        if self.offload is not None:
            self.offload.flush()
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        # checkpointed blocks recompute their forward here: under the kernel restriction their forward ran with
        with sdpa_restricted(self.strategy.attention):
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
            else:
                loss.backward()

    def backward_unscaled(self, loss: torch.Tensor) -> None:
        """The hand-written loop's backward (``Wrapped.backward``): under a GradScaler the gradients it leaves are the
        true ones, as after torch's ``scaler.unscale_(optimizer)``, so the loop's own clipping or logging before
        ``optimizer_step`` reads what it would without scaling (``memopt.step.grad_scaling``)."""
        if self.scaler is None:
            self.backward(loss)
            return
        if grads_unscaled(self.scaler, self.optimizer):
            rescale_(self.scaler, self.optimizer)  # a second backward of the step: add in the scaled units
        self.backward(loss)
        self.scaler.unscale_(self.optimizer)

    def optimizer_step(self) -> None:
        """Unscale (unless ``backward_unscaled`` did), clip, step, copy master weights back, clear gradients."""
        self._phase("optimizer")
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if self.master is not None:
            self.master.grads_to_masters()
        if self.scaler is not None and not grads_unscaled(self.scaler, self.optimizer):
            self.scaler.unscale_(self.optimizer)
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.master is not None:
            self.master.masters_to_params()
        self._phase("zero_grad")
        self.optimizer.zero_grad(set_to_none=True)
        if self.master is not None:
            self.model.zero_grad(set_to_none=True)
        # the weights have moved: the step is counted before the scheduler runs, so an error of the scheduler's
        # cannot leave a step taken but not counted
        self.steps_done += 1
        if self.lr_scheduler is not None:
            self.scheduler_watch.before_step(self.lr_scheduler)
            try:
                self.lr_scheduler.step()
                self.scheduler_watch.after_step(self.lr_scheduler)
            except Exception as exc:
                raise SchedulerStepFailed(
                    f"step {self.steps_done} updated the weights and is counted, but lr_scheduler.step() then "
                    f"raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} (the learning "
                    "rate stays as it was): fix the scheduler, or leave lr_scheduler= out and step it yourself"
                ) from exc

    def clear_grads(self) -> None:
        """``grad = None`` on every parameter the optimizer steps, and on the bf16 weights behind fp32 masters."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
        if self.scaler is not None:
            forget_unscale(self.scaler, self.optimizer)  # what a hand-written backward unscaled went with them
        if self.master is not None:
            for p in self.master.params:
                p.grad = None

    def _reduction_mode(self, micro: list[Any], counts: list[int]) -> str:
        """"mean" or "sum"; measured on the first micro-batch that carries loss items (a loss of none is 0/0) the
        first time a batch is split under "auto"."""
        if self.reduction is None:
            return "mean"
        if self.reduction.mode == "auto" and len(micro) > 1:
            sample = reduction_sample(micro, counts, causal=self.causal_lm)
            self.reduction.mode = measure_reduction(self.model, sample, self.loss_fn, precision=self.strategy.precision,
                                                    device_type=self.device_type, causal=self.causal_lm)
        return "mean" if self.reduction.mode == "auto" else self.reduction.mode

    def _settle_shift(self, batch: Any) -> None:
        """``causal_lm`` as measured on the first split batch whose counts depend on it (a label at position 0),
        shared with every step of the same wrapped model through ``reduction``. Unsplit batches keep the guess from
        the class: their one pass is weighted 1 whatever the counts (only ``items_seen`` reads them)."""
        if self.reduction is None:
            return
        if self.reduction.shifted is None and first_label_decides(batch):
            measured = measure_label_shift(self.model, batch, self.loss_fn, precision=self.strategy.precision,
                                           device_type=self.device_type, device=self.device)
            self.reduction.shifted = self.causal_lm if measured is None else measured
        if self.reduction.shifted is not None:
            self.causal_lm = self.reduction.shifted

    def _normalised_by_batch(self, batch: Any, micro: list[Any], counts: list[int]) -> bool:
        """Whether the loss divides by a ``num_items_in_batch`` the batch carries (each micro-batch gets the whole
        batch's): measured once, on the first micro-batch with loss items."""
        if self.reduction is None or not isinstance(batch, Mapping) or NUM_ITEMS not in batch:
            return False
        if self.reduction.num_items is None:
            self.reduction.num_items = num_items_normalises(self.model, first_labelled(micro, counts, micro[0]),
                                                            self.loss_fn, precision=self.strategy.precision,
                                                            device_type=self.device_type)
        return self.reduction.num_items

    def _padding_verdict(self, sample: Any) -> tuple[bool, str]:
        """Whether the loss of ``sample`` (a micro-batch, moved to the device here) is unchanged by right padding,
        measured in fp32 without autocast (a bf16 forward differs by more than the check's 2e-6 between sequence
        lengths) with this step's loss: ``padding_invariant``."""
        with sdpa_restricted(self.strategy.attention), torch.autocast(self.device_type, enabled=False):
            # under chunked cross-entropy the loss is still the model's own, computed in pieces
            return padding_invariant(self.model, micro_batch_to(sample, self.device),
                                     lambda model, batch: _batch.compute_loss(model, batch, self.loss_fn))

    def step(self, batch: Any) -> float:
        """One optimizer step over ``batch`` (the global batch); returns the batch's loss (its mean, or its sum
        for a summed loss). Starts from no gradient on the parameters it trains: a step is a whole optimizer step
        over ``batch``, and what another step left on them (a GAN generator's loss backpropagates into the
        discriminator) is not this batch's."""
        self.clear_grads()
        micro = split_batch(batch, self.strategy.micro_batch_size)
        if len(micro) > 1:  # one pass over the whole batch weighs nothing, whichever way the labels shift
            self._settle_shift(batch)
        if self.padding is not None and len(micro) > 1:
            counts, micro = self.padding.counts_and_micro(micro, self.causal_lm, self._padding_verdict)
        else:
            counts = loss_item_counts(micro, self.causal_lm)
        total_items = sum(counts)
        if total_items == 0:
            raise ValueError("the batch has no tokens that carry loss (every label is -100)")
        micro = _stage(micro, self.device)
        # a loss divided by the batch's own count is each micro-batch's share of the whole: added, not weighted
        summed = len(micro) > 1 and self._normalised_by_batch(batch, micro, counts)
        weights = micro_batch_weights(counts, "sum" if summed else self._reduction_mode(micro, counts))
        total = 0.0
        self.last_micro_losses = []
        try:
            for i, (mb, w) in enumerate(zip(micro, weights)):
                if w == 0 and counts[i] == 0:
                    # a mean over no labelled item is 0/0: its forward would add nothing but NaN gradients, which
                    # the whole batch's one pass never sees
                    continue
                self._phase(f"forward[{i}]")
                loss = self.loss(mb)
                weighted = loss * w
                self._phase(f"backward[{i}]")
                self.backward(weighted)
                value = loss.detach()
                self.last_micro_losses.append(value)
                total = total + value * w
                del loss, weighted
        except BaseException:
            # a step that failed part-way (a bad batch, the user's loss raising, an interrupt) did not happen: the
            # gradients its earlier micro-batches accumulated must not leak into the next step
            discard_accumulation(self)
            raise
        self.optimizer_step()
        if isinstance(total, torch.Tensor) and type(total).__name__ != "FakeTensor":
            return float(total)
        return float("nan") if isinstance(total, torch.Tensor) else float(total)


def discard_accumulation(step: Any) -> None:
    """Drop what a step that did not finish accumulated: every gradient (the optimizer's groups, the model, fp32
    masters), the micro-batch losses, and activations still offloaded. ``step`` is a ``TrainStep`` or an adapter
    with its surface (the guard's ``Steppable``): what it lacks is skipped."""
    for group in step.optimizer.param_groups:
        for p in group["params"]:
            p.grad = None
    scaler = getattr(step, "scaler", None)
    if scaler is not None:
        forget_unscale(scaler, step.optimizer)
    model = getattr(step, "model", None)
    if model is not None:
        model.zero_grad(set_to_none=True)
    master = getattr(step, "master", None)
    if master is not None:
        for m in master.masters:
            m.grad = None
    offload = getattr(step, "offload", None)
    if offload is not None:
        offload.flush()
    if hasattr(step, "last_micro_losses"):
        step.last_micro_losses = []
