"""Applying a strategy to a model: every technique in one fixed order, each with its undo.

The order matters:
  0. training hygiene: a Hugging Face model stops building a KV cache (in training it only holds
     every layer's keys and values alive, and checkpoint recomputation would append to it twice);
  1. precision casts the weights first, so everything after sees their final dtype (and the
     fp32 master copies are taken from the weights as the user gave them);
  2. the attention backend is a global switch, independent of the module tree;
  3. activation checkpointing wraps the blocks' ``forward``; later wrappers (offload hooks, the
     train step's autocast) sit outside it, so recomputation happens under the same autocast;
  3b. quantization and adapters (``strategy.extras`` "quantization" / "adapters"): the block linears are
     swapped for frozen quantized layers (bitsandbytes; fake-tensor stand-ins when tracing), then peft puts
     trainable adapters on them and freezes everything else; both change modules *inside* the blocks, so the
     checkpoint wrappers of 3 and the casts of 1 (done on the full-precision weights) stay valid;
  4. the optimizer is built last over the parameters as they now are (master copies for bf16_master;
     only the adapters when adapters are on);
  5. the gradient scaler (fp16) and activation offload live in the train step.
Sharding and parameter offload (later) slot in between 3 and 4.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memopt.blocks import BlockStack, find_block_stacks
from memopt.models.hf_task import is_causal_lm
from memopt.step.train_step import LossFn, TrainStep
from memopt.strategy import Strategy
from memopt.techniques.activation_offload import ActivationOffload
from memopt.techniques.attention import apply_attention_backend
from memopt.techniques.checkpointing import apply_checkpointing
from memopt.techniques.optimizers import build_optimizer
from memopt.techniques.precision import MasterWeights, cast_model, uses_grad_scaler
from memopt.techniques.quantization_apply import is_quantized

__all__ = ["Prepared", "prepare"]

OptimizerSpec = str | Callable[..., torch.optim.Optimizer] | None


@dataclass
class Prepared:
    """A model with a strategy applied, its optimizer and the step that trains it."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    step: TrainStep
    stacks: list[BlockStack]
    undo_stack: list[Callable[[], None]] = field(default_factory=list)

    def undo(self) -> None:
        """Remove every technique, newest first (weights keep their trained values)."""
        while self.undo_stack:
            self.undo_stack.pop()()


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


def _move(model: nn.Module, device: torch.device) -> Callable[[], None]:
    """Move the model to the training device; the undo moves it back where it was."""
    first = next(model.parameters(), None)
    before = first.device if first is not None else None
    if before == device:
        return lambda: None
    model.to(device)
    return (lambda: model.to(before)) if before is not None else (lambda: None)


def _optimizer(strategy: Strategy, params: list[nn.Parameter], spec: OptimizerSpec, kwargs: dict[str, Any],
               fake: bool, host_device: str) -> torch.optim.Optimizer:
    if strategy.optimizer == "user":
        if not callable(spec):
            raise ValueError("strategy.optimizer='user' needs optimizer=<callable taking the parameters>")
        return spec(params)
    if fake and strategy.eight_bit_optimizer:
        from memopt.profile.stand_ins import Fake8bitAdamW

        return Fake8bitAdamW(params, paged=strategy.optimizer == "paged_adamw8bit", state_device=host_device,
                             **kwargs)
    return build_optimizer(strategy.optimizer, params, **kwargs)


def prepare(model: nn.Module, strategy: Strategy, *, device_type: str, device: torch.device | str | None = None,
            optimizer: OptimizerSpec = None, optimizer_kwargs: dict[str, Any] | None = None,
            loss_fn: LossFn | None = None, fake: bool = False, host_device: str = "cpu",
            max_grad_norm: float | None = None, lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
            stacks: list[BlockStack] | None = None, move_to: torch.device | str | None = None) -> Prepared:
    """Apply ``strategy`` to ``model`` (in place, reversibly) and build its optimizer and train step."""
    undo: list[Callable[[], None]] = []
    try:
        # 0. no KV cache in training
        undo.append(disable_kv_cache(model))
        # 1. precision (before moving: weights stored in bf16 never occupy the GPU in fp32); bf16_master keeps the
        #    fp32 originals to become the master weights, so no precision is lost in the cast
        adapters = strategy.extra("adapters") is not None
        originals = [p for p in model.parameters() if p.requires_grad] if (
            strategy.precision == "bf16_master" and not adapters) else []
        undo.append(cast_model(model, strategy.precision))
        quantize = strategy.extra("quantization") is not None and not is_quantized(model)
        # a model to be quantized moves after its linears are quantized (3b), straight onto the device one layer at a
        # time: its full-precision weights never sit in device memory together
        if move_to is not None and not quantize:
            undo.append(_move(model, torch.device(move_to)))
        # 2. attention backend
        undo.append(apply_attention_backend(model, strategy.attention))
        # 3. activation checkpointing
        stacks = find_block_stacks(model) if stacks is None else stacks
        if strategy.checkpointing.mode != "none" and not stacks:
            raise ValueError("activation checkpointing needs repeated blocks (an nn.ModuleList of identical "
                             "layers), and this model has none; use checkpointing mode 'none'")
        undo.append(apply_checkpointing(stacks, strategy.checkpointing))
        # 3b. quantization and adapters (memopt.techniques.quantization_apply / .adapters; imported here so that
        #     peft and bitsandbytes load only when used)
        if quantize:
            from memopt.techniques.quantization_apply import apply_quantization

            target_device = move_to if move_to is not None and not fake else None
            undo.append(apply_quantization(model, strategy.extra("quantization"), fake=fake, device=target_device))
            if move_to is not None:
                undo.append(_move(model, torch.device(move_to)))
        if adapters:
            from memopt.techniques.adapters import apply_adapters

            undo.append(apply_adapters(model, strategy.extra("adapters"), fake=fake)[1])
        # 4. optimizer (over fp32 masters for bf16_master)
        params = [p for p in model.parameters() if p.requires_grad]
        master = None
        if strategy.precision == "bf16_master":
            target = move_to if move_to is not None else (params[0].device if params else None)
            # with adapters the trained parameters are the new adapter weights: each master starts from its own
            # parameter (MasterWeights' default), not from the base model's originals
            sources = None if adapters else [o.detach().to(target) for o in originals]
            master = MasterWeights(params, sources=sources)
            params = master.masters
        opt = _optimizer(strategy, params, optimizer, dict(optimizer_kwargs or {}), fake, host_device)
        # 5. gradient scaler and activation offload
        scaler = None
        if uses_grad_scaler(strategy.precision):
            if fake:
                from memopt.profile.stand_ins import FakeGradScaler

                scaler = FakeGradScaler(device_type)
            else:
                scaler = torch.amp.GradScaler(device_type)
        offload = ActivationOffload(device_type, host_device=host_device) if strategy.activation_offload else None
        step = TrainStep(model=model, optimizer=opt, strategy=strategy, device_type=device_type, device=device,
                         loss_fn=loss_fn, scaler=scaler, master=master, offload=offload,
                         max_grad_norm=max_grad_norm, causal_lm=is_causal_lm(model),
                         lr_scheduler=lr_scheduler(opt) if lr_scheduler is not None else None)
    except Exception:
        while undo:
            undo.pop()()
        raise
    return Prepared(model=model, optimizer=opt, step=step, stacks=stacks, undo_stack=undo)
