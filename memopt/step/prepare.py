"""Applying a strategy to a model: every technique in one fixed order, each with its undo.

The techniques that change the model are applied through the registry (``ModelTechnique.apply``), in
``APPLY_ORDER``; the order matters:
  0. training hygiene: a Hugging Face model stops building a KV cache (in training it only holds
     every layer's keys and values alive, and checkpoint recomputation would append to it twice);
  1. precision casts the weights first, so everything after sees their final dtype (and the
     fp32 master copies are taken from the weights as the user gave them); the weights are still on the host,
     so weights stored in bf16 never occupy the GPU in fp32;
  2. the attention backend: flash-attn set on a Hugging Face model's config (PyTorch's SDPA backends change nothing
     here: the train step restricts SDPA only around its own passes, ``memopt.techniques.attention``);
  3. activation checkpointing wraps the blocks' ``forward``; later wrappers (offload hooks, the
     train step's autocast) sit outside it, so recomputation happens under the same autocast;
  4. quantization swaps the block linears for frozen quantized layers (bitsandbytes; the profile's stand-ins
     when tracing), made straight on the training device one layer at a time; it changes modules *inside* the
     blocks, so the checkpoint wrappers of 3 and the casts of 1 (done on the full-precision weights) stay valid;
  5. placement: the model moves to the training device (prepare's own step, not a technique);
  6. adapters: peft freezes everything and puts trainable adapters on the (quantized) linears, on the device;
  7. the optimizer is built last over the parameters as they now are (master copies for bf16_master;
     only the adapters when adapters are on);
  8. the gradient scaler (fp16), activation offload, chunked cross-entropy and the micro-batches live in the
     train step, which reads them from the strategy.
Sharding and parameter offload (the DeepSpeed/FSDP2 engines, ``memopt.distributed``) wrap the model as 7 leaves it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memopt.blocks import BlockStack, find_block_stacks
from memopt.errors import UserArgumentError
from memopt.models.hf_task import is_causal_lm
from memopt.step.loss_reduction import LossReduction
from memopt.step.right_padding import PaddingCut
from memopt.step.train_step import LossFn, TrainStep
from memopt.strategy import Strategy
from memopt.techniques.activation_offload import ActivationOffload
from memopt.techniques.model_change import ModelChange, Undo, no_change
from memopt.techniques.optimizer_instance import scheduler_refusal, user_optimizer
from memopt.techniques.optimizers import build_optimizer
from memopt.techniques.precision import MasterWeights, uses_grad_scaler
from memopt.techniques.registry import model_technique

__all__ = ["APPLY_ORDER", "Prepared", "StandIns", "keeps_placement", "prepare"]

# the techniques that change the model, in the order they are applied (the module docstring says why);
# "placement" is prepare's own move to the training device
APPLY_ORDER: tuple[str, ...] = ("precision", "attention", "checkpointing", "quantization", "placement", "adapters")

OptimizerSpec = str | Callable[..., torch.optim.Optimizer] | None


@dataclass(frozen=True)
class StandIns:
    """What a fake-tensor trace runs in place of the pieces that need real values or a GPU kernel: the fp16 gradient
    scaler (it reads ``found_inf.item()``), bitsandbytes' 8-bit AdamW (``.tolist()`` in its constructor) and its
    quantized linears (no fake kernels for their storage). The profile owns them (``memopt.profile.stand_ins``) and
    passes them in, since the step sits below the traces; ``prepare`` with stand-ins builds a step to be traced."""

    grad_scaler: Callable[[str], Any]  # device type -> a scaler
    quantized_linear: Callable[[nn.Linear, Any], nn.Module]  # (linear, QuantSetting) -> a quantized stand-in


@dataclass
class Prepared:
    """A model with a strategy applied, its optimizer and the step that trains it."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    step: TrainStep
    stacks: list[BlockStack]
    undo_stack: list[Callable[[], None]] = field(default_factory=list)
    placement: int | None = None  # where the undo that moves the model back home is in ``undo_stack``

    def undo(self, *, keep_on_device: bool = False) -> Callable[[], None] | None:
        """Remove every technique, newest first (weights keep their trained values). ``keep_on_device``: the model
        stays on the training device, and the undo that would have moved it home is returned instead of run (for
        the next strategy applied to it: :meth:`adopt_placement`), which saves a round trip through host memory per
        strategy when several are tried in turn; None when nothing was kept."""
        home: Callable[[], None] | None = None
        while self.undo_stack:
            step = self.undo_stack.pop()
            if keep_on_device and len(self.undo_stack) == self.placement:
                home = step
                continue
            step()
        return home

    def adopt_placement(self, home: Callable[[], None] | None) -> None:
        """Take ``home`` (what an earlier strategy's :meth:`undo` kept) as this one's move back: applied to a model
        already on the device, its own placement moved nothing and would leave the model there (None: keep this
        one's own)."""
        if home is not None and self.placement is not None:
            self.undo_stack[self.placement] = home


def keeps_placement(strategy: Strategy) -> bool:
    """Whether a model can stay on the device between two strategies: ones that change no weight's dtype or layout
    before placement (a cast precision keeps its full-precision originals, and quantization its unquantized layers,
    where the model was: moved together, they would take device memory the plan does not count)."""
    return strategy.precision in ("fp32", "bf16_autocast", "fp16_autocast") and strategy.extra("quantization") is None


def disable_kv_cache(model: nn.Module) -> Callable[[], None]:
    """use_cache=False on every config in the model (encoder-decoders copy the config per stack)."""
    configs = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "use_cache", False):
            configs[id(config)] = config
    for config in configs.values():
        config.use_cache = False

    def undo() -> None:
        for config in configs.values():
            config.use_cache = True

    return undo


def disable_own_checkpointing(model: nn.Module) -> Callable[[], None]:
    """Turn off checkpointing the model does by itself (Hugging Face's ``gradient_checkpointing_enable()``, a common
    line of fine-tuning scripts), which would recompute every block on top of what the plan checkpoints: the plan
    decides which blocks recompute, and its estimate is of a model that does not checkpoint itself. The undo turns
    it back on."""
    own = [m for m in model.modules()
           if getattr(m, "gradient_checkpointing", None) is True and hasattr(m, "_gradient_checkpointing_func")]
    for m in own:
        m.gradient_checkpointing = False

    def undo() -> None:
        for m in own:
            m.gradient_checkpointing = True

    return undo


def _place(change: ModelChange) -> Undo:
    """Placement: the model (its quantized layers already there) moves to the training device."""
    return _move(change.model, change.move_to) if change.move_to is not None else no_change


def _move(model: nn.Module, device: torch.device) -> Callable[[], None]:
    """Move the model to the training device; the undo moves it back where it was."""
    first = next(model.parameters(), None)
    before = first.device if first is not None else None
    if all(t.device == device for t in itertools.chain(model.parameters(), model.buffers())):
        return lambda: None
    model.to(device)
    return (lambda: model.to(before)) if before is not None and before != device else (lambda: None)


def _optimizer(strategy: Strategy, params: list[nn.Parameter], spec: OptimizerSpec, kwargs: dict[str, Any],
               stand_ins: StandIns | None, host_device: str) -> torch.optim.Optimizer:
    if strategy.optimizer == "user":
        if not callable(spec):
            raise ValueError("strategy.optimizer='user' needs optimizer=<callable taking the parameters>")
        return user_optimizer(spec, params)
    rebuild = getattr(spec, "as_variant", None)
    if rebuild is not None and stand_ins is None:  # a pinned variant of the user's instance: its groups, its values
        return rebuild(lambda groups: build_optimizer(strategy.optimizer, groups, **kwargs), params)
    # in a fake-tensor trace, the variant's stand-in where the real optimizer needs real values
    return build_optimizer(strategy.optimizer, params, trace_on=host_device if stand_ins is not None else None,
                           **kwargs)


def _scheduler(factory: Callable[[torch.optim.Optimizer], Any] | None, optimizer: torch.optim.Optimizer) -> Any:
    if factory is None:
        return None
    built = factory(optimizer)
    if not all(hasattr(built, name) for name in ("step", "state_dict", "load_state_dict")):
        raise ValueError(f"lr_scheduler= returned a {type(built).__name__}, not a learning-rate scheduler: pass a "
                         "callable optimizer -> scheduler, e.g. lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, f)")
    refusal = scheduler_refusal(built, "the scheduler lr_scheduler= built")
    if refusal is not None:
        raise UserArgumentError(refusal)
    return built


def prepare(model: nn.Module, strategy: Strategy, *, device_type: str, device: torch.device | str | None = None,
            optimizer: OptimizerSpec = None, optimizer_kwargs: dict[str, Any] | None = None,
            loss_fn: LossFn | None = None, stand_ins: StandIns | None = None, host_device: str = "cpu",
            max_grad_norm: float | None = None, lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
            stacks: list[BlockStack] | None = None, move_to: torch.device | str | None = None,
            loss_reduction: LossReduction | None = None, padding_cut: PaddingCut | None = None) -> Prepared:
    """Apply ``strategy`` to ``model`` (in place, reversibly) and build its optimizer and train step (to be traced
    on fake tensors when ``stand_ins`` are given). ``loss_reduction``: how the loss reduces over samples, shared
    with every other step built for the same user (``memopt.step.loss_reduction``); None: a mean. ``padding_cut``:
    whether trailing padding is cut off each micro-batch, shared the same way (``memopt.step.right_padding``); None:
    never cut."""
    undo: list[Callable[[], None]] = []
    try:
        undo.append(disable_kv_cache(model))
        undo.append(disable_own_checkpointing(model))
        change = ModelChange(model=model, strategy=strategy,
                             stacks=find_block_stacks(model) if stacks is None else stacks,
                             move_to=torch.device(move_to) if move_to is not None else None,
                             fake=stand_ins is not None,
                             quantized_stand_in=stand_ins.quantized_linear if stand_ins is not None else None)
        placement = None
        for name in APPLY_ORDER:
            if name == "placement":
                placement = len(undo)
            undo.append(_place(change) if name == "placement" else model_technique(name).apply(change))
        adapters = strategy.extra("adapters") is not None
        # 7. optimizer (over fp32 masters for bf16_master)
        params = [p for p in model.parameters() if p.requires_grad]
        master = None
        if strategy.precision == "bf16_master":
            target = move_to if move_to is not None else (params[0].device if params else None)
            # with adapters the trained parameters are the new adapter weights: each master starts from its own
            # parameter (MasterWeights' default), not from the base model's originals
            sources = None if adapters else [o.detach().to(target) for o in change.originals]
            master = MasterWeights(params, sources=sources)
            params = master.masters
            if not adapters:
                change.master = master
        opt = _optimizer(strategy, params, optimizer, dict(optimizer_kwargs or {}), stand_ins, host_device)
        # 8. gradient scaler and activation offload
        scaler = None
        if uses_grad_scaler(strategy.precision):
            make = stand_ins.grad_scaler if stand_ins is not None else torch.amp.GradScaler
            scaler = make(device_type)
        offload = ActivationOffload(device_type, host_device=host_device) if strategy.activation_offload else None
        step = TrainStep(model=model, optimizer=opt, strategy=strategy, device_type=device_type, device=device,
                         loss_fn=loss_fn, scaler=scaler, master=master, offload=offload,
                         max_grad_norm=max_grad_norm, causal_lm=is_causal_lm(model), reduction=loss_reduction,
                         padding=padding_cut,
                         lr_scheduler=_scheduler(lr_scheduler, opt))
    except BaseException:
        # an interrupt (Ctrl-C during a slow wrap) is undone as an error is: a model left half changed (bf16
        # weights, patched forwards) would be taken for the user's own by the next wrap
        while undo:
            undo.pop()()
        raise
    return Prepared(model=model, optimizer=opt, step=step, stacks=change.stacks, undo_stack=undo, placement=placement)
