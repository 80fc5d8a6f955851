"""OOM recovery under a Hugging Face ``Trainer``: the plan's micro-batches run inside ``training_step``.

With the Trainer's own gradient accumulation an out-of-memory error in micro-batch j > 0 leaves the gradients
of micro-batches 0..j-1 mixed with part of j's, and the earlier micro-batches are no longer at hand: the step
can be neither rolled back nor retried. So ``memopt.wrap(trainer, ...)`` (``recover=True``, the default) sets
the Trainer to one accumulation step over the whole global batch per process, and ``MicroBatchedTrainingStep``
replaces ``trainer.training_step``: it splits that batch into the plan's micro-batches and runs the Trainer's own
``training_step`` on each. At the start of a Trainer step the gradients are empty (the Trainer zeroes them after
every optimizer step), so after an OOM anywhere in forward or backward they are cleared, the plan is escalated
(a smaller micro-batch, then more checkpointing; precision and optimizer stay), and the same batch is retried:
no sample is skipped or counted twice, and the step count is unchanged.

Exactness: when the loss is normalized by the number of loss tokens of the whole batch (``num_items_in_batch``, the
default for Hugging Face models; measured once, for the model's loss or the script's), every micro-batch's loss is
already a share of the batch's, and the gradients add up to the whole batch's. Otherwise each micro-batch's mean
loss is weighted by its share of the batch's loss tokens (samples, for per-sample labels) before backward. A loss
of the script's own (a ``compute_loss`` override) or one memopt does not know for a task head's is measured at the
first split batch (``memopt.step.loss_reduction.classify_reduction``): a sum is accumulated unweighted, and a loss
that no weighting of micro-batches reproduces (in-batch negatives, a mean weighted by a column of the batch) is
refused.

Padding: the collator padded the whole batch to its longest row, so a micro-batch carries columns that are padding
in all of its rows, which a script accumulating by hand (its collator pads each micro-batch to its own longest
row) never computes. Where the model's loss is measured to be unchanged by right padding (once, on the first split
batch: ``memopt.step.right_padding.padding_invariant``) those trailing columns are cut off each micro-batch before
its forward; only ``-100`` labels go with them, so the loss-token counts stay. The plan's notes say which.

The Trainer's optimizer step (outside ``training_step``) is made all-or-nothing and retried by
``memopt.integrations.trainer_optimizer_step``, installed on the Trainer's optimizer at the first step; its
failures and switches go into the same report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from memopt.guard.escalation import EscalationFailed, PlanEscalator, step_down
from memopt.guard.oom import (
    MemoptOOMError,
    OOMMeasurement,
    RecoveryReport,
    parse_oom_message,
    release_cache,
)
from memopt.integrations.trainer_loss import TrainerLoss, script_loss, trainer_loss
from memopt.integrations.trainer_optimizer_step import TransactionalOptimizerStep, torch_optimizer
from memopt.integrations.trainer_setup import TrainerCheckpointing
from memopt.models.hf_task import is_causal_lm
from memopt.plan.schema import Plan
from memopt.step.batch import as_loss
from memopt.step.loss_items import divides_by_count, first_label_decides, measure_label_shift
from memopt.step.loss_reduction import (
    LossNotSplittable,
    classify_reduction,
    first_labelled,
    own_loss_unknown,
    reduction_sample,
    settle,
)
from memopt.step.right_padding import PaddingCut, model_loss, padding_invariant
from memopt.step.side_effects import preserved_random_state
from memopt.step.train_step import split_batch
from memopt.strategy import Checkpointing

__all__ = ["MicroBatchedTrainingStep", "trainer_escalator"]

Escalate = Callable[[Plan, OOMMeasurement | None, int], Plan]


def trainer_escalator(profile: Any = None) -> Escalate:
    """Escalation a running Trainer can apply: the planner on ``profile`` (or ``step_down`` without one) with the
    running precision and optimizer pinned (memopt checkpoints the blocks itself: any setting applies)."""
    def escalate(plan: Plan, measured: OOMMeasurement | None, attempt: int) -> Plan:
        s = plan.strategy
        pins = {**plan.policy.get("pins", {}), "precision": s.precision, "optimizer": s.optimizer}
        pinned = dataclasses.replace(plan, policy={**plan.policy, "pins": pins})
        if profile is not None:
            new = PlanEscalator(profile)(pinned, measured, attempt)
        else:
            new = step_down(pinned, measured, attempt)
        return new

    return escalate


def _own_forward(module: torch.nn.Module) -> Any:
    """``module``'s forward without the wrappers set on the instance (accelerate wraps it in autocast for mixed
    precision, and says so with ``__wrapped__``); None when nothing wraps it."""
    wrapped = module.__dict__.get("forward")
    if wrapped is None:
        return None
    inner = inspect.unwrap(getattr(wrapped, "__func__", wrapped))
    if inner is getattr(wrapped, "__func__", wrapped):
        return None
    return inner if inspect.ismethod(inner) else types.MethodType(inner, module)


@contextlib.contextmanager
def _full_precision_forward(model: torch.nn.Module) -> Iterator[None]:
    """The model's own forward in fp32 while inside: the autocast wrappers on the model's instance, and on the module
    a DDP-style wrapper holds (``.module``: accelerate wraps the forward before DDP wraps the model), are stepped
    around, and any autocast around the call is turned off. The padding check compares two losses to 1e-4, which
    bf16 kernels picked by sequence length do not meet even where the model is invariant."""
    chain = [model]
    while isinstance(getattr(chain[-1], "module", None), torch.nn.Module):
        chain.append(chain[-1].module)
    swapped = [(m, m.__dict__["forward"], own) for m in chain if (own := _own_forward(m)) is not None]
    devices = {"cpu"} | {p.device.type for p in model.parameters() if p.device.type != "meta"}
    with contextlib.ExitStack() as stack:
        for device in sorted(devices):
            stack.enter_context(torch.autocast(device, enabled=False))
        for m, _, own in swapped:
            m.forward = own
        try:
            yield
        finally:
            for m, wrapped, _ in swapped:
                m.forward = wrapped


def _copy(batch: Any) -> Any:
    """A shallow copy of a batch dict (``compute_loss`` pops the labels out of the one it is given)."""
    return dict(batch) if isinstance(batch, Mapping) else batch


class MicroBatchedTrainingStep:
    """``trainer.training_step`` over the plan's micro-batches, retried after an OOM with an escalated plan."""

    def __init__(self, trainer: Any, plan: Plan, *, escalate: Escalate | None = None, max_escalations: int = 3,
                 causal_lm: bool | None = None, transaction: str = "auto") -> None:
        self.trainer = trainer
        self.plan = plan
        self.escalate = escalate or trainer_escalator()
        self.max_escalations = max_escalations
        self.report = RecoveryReport()
        self._original = trainer.training_step  # the Trainer's bound method
        model = trainer.model
        self.causal_lm = is_causal_lm(model) if causal_lm is None else causal_lm
        self.transaction = transaction
        self.optimizer_step: TransactionalOptimizerStep | None = None
        self._loss_takes_num_items: bool | None = None
        self._shift_measured = False
        self._own_mode: str | None = None  # how the model's own loss reduces: measured at the first split batch
        self.padding = PaddingCut()  # trailing padding cut off each micro-batch, decided at the first split batch

    # -- installing ------------------------------------------------------------------------------
    def install(self) -> MicroBatchedTrainingStep:
        self.trainer.training_step = self
        return self

    def uninstall(self) -> None:
        if self.trainer.__dict__.get("training_step") is self:
            del self.trainer.training_step
        if self.optimizer_step is not None:
            self.optimizer_step.uninstall()
            self.optimizer_step = None

    def _guard_optimizer(self) -> None:
        """The Trainer creates its optimizer in ``train()``, before the first ``training_step``: guard its step."""
        opt = getattr(self.trainer, "optimizer", None)
        if opt is None:
            return
        inner = torch_optimizer(opt)
        if self.optimizer_step is not None and self.optimizer_step.optimizer is inner:
            return
        if self.optimizer_step is not None:
            self.optimizer_step.uninstall()
        peak_at = str(self.plan.prediction.get("peak_at") or "")
        self.optimizer_step = TransactionalOptimizerStep(
            inner, report=self.report, mode=self.transaction, plan_at_risk="optimizer" in peak_at,
            step_of=lambda: getattr(self.trainer.state, "global_step", 0), on_switch=self._optimizer_switched)

    def _optimizer_switched(self, name: str | None) -> None:
        """The optimizer step now runs one tensor at a time: the plan says so (same update, same states)."""
        if name is not None and self.plan.strategy.optimizer != name:
            self.plan = dataclasses.replace(self.plan, strategy=self.plan.strategy.replace(optimizer=name))
            self.trainer.memopt_plan = self.plan

    # -- the step -----------------------------------------------------------------------------------
    def __call__(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        self._guard_optimizer()
        attempt = 1
        while True:
            try:
                return self._run(model, inputs, num_items_in_batch)
            except torch.OutOfMemoryError as exc:
                failure = self._failure(exc, attempt)
                self._free(model)  # the gradients; the failed frames' tensors go when the handler ends
                self.report.failures.append(failure)
                if attempt > self.max_escalations:
                    self.report.final = f"gave up after {self.max_escalations} escalations"
                    raise MemoptOOMError(f"out of memory {attempt} times in one Trainer step; the model, optimizer "
                                         "and data position are as before this step", self.report) from exc
                try:
                    new = self.escalate(self.plan, failure, attempt)
                except (EscalationFailed, ValueError) as esc:
                    self.report.final = f"no plan needs less memory: {esc}"
                    raise MemoptOOMError(f"out of memory and no smaller plan: {esc}; the model, optimizer and data "
                                         "position are as before this step", self.report) from exc
                self._apply(new, model, attempt)
            release_cache()  # outside the handler: the failed attempt's activations are free now
            attempt += 1

    def _run(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any) -> torch.Tensor:
        micro = split_batch(inputs, self.plan.strategy.micro_batch_size)
        if len(micro) == 1:
            return self._original(model, inputs, num_items_in_batch)
        tr = self.trainer
        self._settle_shift(inputs)
        counts, micro = self.padding.counts_and_micro(micro, self.causal_lm, lambda s: self._verdict(model, s))
        # the loss is already a share of the whole batch's when it is divided by the batch's loss tokens: by a
        # model whose loss takes num_items_in_batch, or by the script's own loss. The Trainer assumes the former of
        # every model whose forward takes **kwargs and the latter of every compute_loss_func; T5, other
        # hand-written losses and a script's mean take the micro-batch's mean instead, and would be summed over the
        # micro-batches. So it is measured (once: _loss_uses_num_items). In one process the weighted means below are
        # exact for either kind; across processes the batch's token count spans all of them, so a loss that uses it
        # keeps it
        normalized = num_items_in_batch is not None and (
            (script_loss(tr) or getattr(tr, "model_accepts_loss_kwargs", False))
            and self._loss_uses_num_items(model, first_labelled(micro, counts, micro[0]), num_items_in_batch))
        own = self._own_loss_mode(model, micro, counts, normalized)
        summed = not normalized and own == "sum"
        note = self.padding.note()
        if note:
            self.plan.notes.append(note)
        total_items = max(1, sum(counts))
        skip_empty = not normalized and sum(counts) > 0
        total: torch.Tensor | None = None
        for mb, n in zip(micro, counts):
            if n == 0 and skip_empty:
                continue  # a mean over no labelled token is 0/0: NaN gradients the whole batch's pass never has
            # not normalized: each micro-batch's mean loss (num_items_in_batch withheld, so that no part of the
            # Trainer divides by it) weighted by its share of the batch's loss items
            with contextlib.nullcontext() if normalized or summed else self._weighted(n / total_items):
                loss = self._original(model, mb, num_items_in_batch if normalized else None)
            total = loss if total is None else total + loss
        assert total is not None
        return total

    def _settle_shift(self, inputs: dict[str, Any]) -> None:
        """``causal_lm`` measured on the first batch whose count depends on it (``memopt.step.loss_items``), with the
        model's own loss; in one process only (a forward on one rank alone would wait on the others' collectives),
        and not for a script's loss (the class's word stands for those)."""
        if self._shift_measured or not first_label_decides(inputs):
            return
        self._shift_measured = True
        if getattr(self.trainer.args, "world_size", 1) != 1 or script_loss(self.trainer):
            return
        with _full_precision_forward(self.trainer.model):
            measured = measure_label_shift(self.trainer.model, inputs, None, precision="fp32",
                                           device_type=self.trainer.args.device.type,
                                           device=self.trainer.args.device)
        if measured is not None:
            self.causal_lm = measured

    def _own_loss_mode(self, model: torch.nn.Module, micro: list[Any], counts: list[int], normalized: bool) -> str:
        """"mean" or "sum": how the loss reduces over the samples, measured once where it is not a task head's
        cross-entropy: the script's own (a ``compute_loss`` override, a ``compute_loss_func`` not handed the batch's
        item count: ``normalized``), or a model's loss memopt does not know (``own_loss_unknown``: a contrastive
        loss, CTC, a router's load-balancing term). A loss that micro-batches cannot reproduce (one over in-batch
        negatives, a mean weighted by a column of the batch) is refused before anything trains."""
        if self._own_mode is None:
            script = script_loss(self.trainer)
            loss_fn = as_loss(None, TrainerLoss(self.trainer)) if script else None
            if script:
                reason = None if normalized else "the Trainer's loss is the script's (compute_loss, compute_loss_func)"
                instead = "or make the script's loss a mean over samples or labelled tokens, or a sum over them"
            else:
                reason = own_loss_unknown(model)
                instead = "or pass compute_loss_func=... to the Trainer with a loss that can be split"
            self._own_mode = "mean"
            if reason is not None:
                sample = reduction_sample(micro, counts, causal=self.causal_lm)
                with _full_precision_forward(model):
                    verdict, why = classify_reduction(model, sample, loss_fn, precision="fp32",
                                                      device_type=self.trainer.args.device.type,
                                                      causal=self.causal_lm)
                if verdict in ("coupled", "masked"):
                    self._own_mode = None
                    raise LossNotSplittable(
                        f"{reason}, and it cannot be split into the plan's micro-batches of "
                        f"{self.plan.strategy.micro_batch_size}: {why}; give a budget that fits the whole batch per "
                        f"device (memopt then does not split it), {instead}")
                self._own_mode = settle(verdict, why)  # "unknown": a mean, with a warning
                self.plan.notes.append(f"{reason}: measured as a {self._own_mode} over the samples ({verdict}"
                                       f"{': ' + why if why else ''}); micro-batches are weighted accordingly")
        return self._own_mode

    def _verdict(self, model: torch.nn.Module, sample: Any) -> tuple[bool, str]:
        """Whether trailing padding may be cut off the micro-batches, measured on ``sample`` (a micro-batch with
        loss items). The loss checked is the model's own (``output.loss``), or the Trainer's ``compute_loss`` where
        only label smoothing makes it differ; a loss of the user's (``compute_loss_func``, a subclass's
        ``compute_loss``) is not checked, and keeps the padding."""
        tr = self.trainer
        parallel = getattr(getattr(tr, "accelerator", None), "parallelism_config", None)
        if script_loss(tr):
            return False, "the Trainer computes the loss itself (compute_loss_func or a compute_loss override)"
        if parallel is not None and getattr(parallel, "cp_enabled", False):
            return False, "context parallelism splits each sequence over the ranks"
        loss_of = TrainerLoss(tr) if trainer_loss(tr) is not None else model_loss
        with _full_precision_forward(model):
            return padding_invariant(model, sample, loss_of)

    def _loss_uses_num_items(self, model: torch.nn.Module, batch: Any, num_items: Any) -> bool:
        """Whether the loss divides by ``num_items_in_batch`` (asked once: ``batch``'s loss in eval mode without
        gradients, with two item counts; the random state and the train mode are restored). The script's loss
        (its ``compute_loss``, its ``compute_loss_func``) through the Trainer's ``compute_loss``, given ``num_items``
        and twice it: it must halve or stay, anything else is refused; else the model's own loss."""
        if self._loss_takes_num_items is None:
            script = script_loss(self.trainer)
            if not script and not isinstance(batch, Mapping):  # a dict, or the collator's BatchEncoding
                self._loss_takes_num_items = False
                return False
            was_training = model.training
            try:
                with preserved_random_state(), torch.no_grad(), _full_precision_forward(model):
                    model.eval()
                    if script:
                        once, twice = (float(self.trainer.compute_loss(model, _copy(batch), num_items_in_batch=n))
                                       for n in (num_items, num_items * 2))
                        self._loss_takes_num_items = divides_by_count(once, twice)
                    else:
                        one, two = (model(**batch, num_items_in_batch=torch.tensor(n)).loss for n in (1, 2))
                        self._loss_takes_num_items = bool(torch.isfinite(one).item() and
                                                          not torch.allclose(one, two, rtol=1e-3, atol=0.0))
            except (TypeError, AttributeError):  # a forward that refuses it, or an output without .loss
                self._loss_takes_num_items = False
            finally:
                model.train(was_training)
        return self._loss_takes_num_items

    @contextlib.contextmanager
    def _weighted(self, weight: float) -> Iterator[None]:
        """The Trainer's ``compute_loss`` scaled by ``weight`` (the micro-batch's share of the batch's mean)."""
        tr = self.trainer
        original = tr.compute_loss

        def scaled(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            if isinstance(out, tuple):
                return (out[0] * weight, *out[1:])
            return out * weight

        tr.compute_loss = scaled
        try:
            yield
        finally:
            if tr.__dict__.get("compute_loss") is scaled:
                del tr.compute_loss

    # -- recovery -----------------------------------------------------------------------------------
    def _failure(self, exc: BaseException, attempt: int) -> OOMMeasurement:
        figures = parse_oom_message(str(exc))
        return OOMMeasurement(step=int(getattr(self.trainer.state, "global_step", 0)), attempt=attempt,
                              phase="forward/backward", location="before_optimizer", message=str(exc)[:300],
                              strategy=self.plan.strategy.label(), requested_bytes=figures["requested_bytes"],
                              allocated_bytes=figures["allocated_bytes"])

    @staticmethod
    def _free(model: torch.nn.Module) -> None:
        """Drop the failed attempt's gradients (the step started without any)."""
        for p in model.parameters():
            p.grad = None

    def _checkpoint(self, model: torch.nn.Module, setting: Checkpointing) -> None:
        """memopt's checkpointing on the Trainer's model (``wrap`` put a ``TrainerCheckpointing`` there)."""
        current = getattr(self.trainer, "memopt_checkpointing", None)
        if current is None:
            current = TrainerCheckpointing(getattr(model, "module", model))
            self.trainer.memopt_checkpointing = current
        try:
            current.apply(setting)
        except ValueError as exc:
            raise MemoptOOMError(f"the escalated plan cannot be applied: {exc}", self.report) from None

    def _apply(self, new: Plan, model: torch.nn.Module, attempt: int) -> None:
        old = self.plan.strategy
        s = new.strategy
        if s.checkpointing != old.checkpointing:
            self._checkpoint(model, s.checkpointing)
        self.report.replans.append({"attempt": attempt, "step": int(getattr(self.trainer.state, "global_step", 0)),
                                    "from": old.label(), "to": s.label()})
        self.plan = new
        self.trainer.memopt_plan = new
