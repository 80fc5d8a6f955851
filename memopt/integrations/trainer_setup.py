"""What ``memopt.wrap(trainer)`` changes on a Trainer that its arguments cannot carry, or carry too late.

* **Precision.** transformers 5.x builds the Trainer's ``Accelerator`` in ``Trainer.__init__``, from
  ``args.mixed_precision`` as it was then; the model's forward is put under autocast when ``train()`` prepares it,
  from the accelerator's state. Setting ``args.bf16`` after the Trainer exists (what ``wrap`` does) leaves that
  state at "no": the plan's bf16 would never run. ``set_trainer_precision`` sets the arguments and the
  accelerator's mixed precision, native-AMP switch and (fp16) gradient scaler as ``Accelerator.__init__`` would
  have, before ``train()`` prepares the model.
* **Activation checkpointing.** Hugging Face's ``gradient_checkpointing`` flag checkpoints every block or none;
  a plan may checkpoint some blocks, or selectively. ``TrainerCheckpointing`` applies memopt's own checkpointing
  (``memopt.techniques.checkpointing``, the code the estimate was made for) to the model's block stacks, and the
  Trainer's flag stays off. An escalated plan re-applies it.
* **The script's random stream.** Planning reads samples of the Trainer's dataset (whose transforms may draw
  random augmentations) and traces the model; ``memopt.step.side_effects.preserved_random_state`` (around
  ``wrap_trainer``'s planning) puts torch's (CPU and CUDA), numpy's and Python's generators back as they were, so
  that the script's augmentations, dropout and sampling after ``wrap`` draw what they would have drawn without
  memopt.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from memopt.blocks import find_block_stacks
from memopt.step.prepare import disable_kv_cache, disable_own_checkpointing
from memopt.strategy import Checkpointing
from memopt.techniques.checkpointing import apply_checkpointing
from memopt.techniques.model_change import no_change

__all__ = ["TrainerCheckpointing", "set_trainer_precision"]

_ACCELERATE_PRECISION = {"bf16_autocast": "bf16", "fp16_autocast": "fp16"}


def set_trainer_precision(trainer: Any, precision: str) -> str:
    """The plan's autocast precision into the Trainer's arguments and its accelerator; returns accelerate's name
    for it ("bf16", "fp16" or "no")."""
    args = trainer.args
    mixed = _ACCELERATE_PRECISION.get(precision, "no")
    args.bf16, args.fp16 = mixed == "bf16", mixed == "fp16"
    if hasattr(args, "mixed_precision"):
        args.mixed_precision = mixed
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is None or accelerator.mixed_precision == mixed:
        return mixed
    from accelerate.utils import DistributedType

    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        raise ValueError(f"the plan trains in {mixed} but the Trainer runs {accelerator.distributed_type.value}, "
                         "whose precision is its own config's: set bf16/fp16 there, or plan with "
                         f"pins={{'precision': <that precision>}}")
    state = accelerator.state
    state._mixed_precision = mixed
    device = accelerator.device.type
    accelerator.scaler = None
    if mixed == "bf16":
        from accelerate.utils import is_bf16_available

        accelerator.native_amp = device in ("cpu", "xpu", "hpu") or is_bf16_available(True)
    elif mixed == "fp16":
        if device == "cpu":
            raise ValueError("the plan trains in fp16 autocast, which needs a GPU, but the Trainer runs on the CPU: "
                             "plan with pins={'precision': 'bf16_autocast'} or 'fp32'")
        from accelerate.utils import get_grad_scaler

        accelerator.native_amp = True
        kwargs = accelerator.scaler_handler.to_kwargs() if accelerator.scaler_handler is not None else {}
        accelerator.scaler = get_grad_scaler(accelerator.distributed_type, **kwargs)
    else:
        accelerator.native_amp = False
    return mixed


def fit_evaluation(trainer: Any, micro_batch_size: int) -> list[str]:
    """Evaluation inside the run stays within the plan: what it changes, as notes.

    An evaluation forward runs without gradients beside the training state, so at the plan's micro-batch size it
    holds less than the planned training step; a larger ``per_device_eval_batch_size`` (8 by default, whatever the
    model) is not planned, and is capped to it. The Trainer keeps every evaluation batch's logits on the GPU until the
    loop ends unless ``eval_accumulation_steps`` is set (a vocabulary's logits per token, for all of the evaluation
    set): it is set to 1, which moves them to the CPU after each batch and changes no metric."""
    args = trainer.args
    evaluates = getattr(args, "eval_strategy", "no") != "no" or getattr(args, "do_eval", False)
    if not evaluates and getattr(trainer, "eval_dataset", None) is None:
        return []
    notes = []
    if args.per_device_eval_batch_size > micro_batch_size:
        notes.append(f"evaluation batch {args.per_device_eval_batch_size} per device capped to the plan's micro-batch "
                     f"of {micro_batch_size}: a larger one is not planned (eval_loss, the Trainer's mean of its "
                     "batches' losses, then averages other batches: with rows of uneven length it can differ slightly)")
        args.per_device_eval_batch_size = micro_batch_size
    if args.eval_accumulation_steps is None and not args.prediction_loss_only:
        args.eval_accumulation_steps = 1
        notes.append("evaluation predictions move to the CPU after each batch (eval_accumulation_steps=1): the "
                     "Trainer would otherwise keep all of them on the GPU")
    return notes


class TrainerCheckpointing:
    """memopt's activation checkpointing on a Trainer's model, for any setting (every block, some, selective)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.stacks = find_block_stacks(model)
        self.setting = Checkpointing(mode="none")
        self._undo: Callable[[], None] | None = None

    def apply(self, setting: Checkpointing) -> None:
        """Checkpoint what ``setting`` says (replacing what was checkpointed before)."""
        if setting == self.setting and self._undo is not None:
            return
        if setting.mode != "none" and not self.stacks:
            raise ValueError(f"the plan checkpoints activations, but {type(self.model).__name__} has no repeated "
                             "blocks (an nn.ModuleList, nn.Sequential or nn.ModuleDict of identical layers) to "
                             "checkpoint: plan with pins={'checkpointing': 'none'}")
        self.remove()
        # the plan decides which blocks recompute: a model that checkpoints itself (gradient_checkpointing_enable()
        # before the Trainer was built) would recompute every block on top
        undo_own = disable_own_checkpointing(self.model)
        undo_checkpointing, undo_cache = no_change, no_change
        if setting.mode != "none":
            undo_checkpointing = apply_checkpointing(self.stacks, setting)
            undo_cache = disable_kv_cache(self.model)  # recomputation would append to a KV cache twice

        def undo() -> None:
            undo_checkpointing()
            undo_cache()
            undo_own()

        self._undo = undo
        self.setting = setting

    def remove(self) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None
        self.setting = Checkpointing(mode="none")
