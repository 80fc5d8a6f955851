"""The loss a Hugging Face Trainer computes, where it is not the model's own: a subclass's ``compute_loss``, a
``compute_loss_func``, or label smoothing (``label_smoothing_factor``, whose smoother takes a log-softmax of the
logits). The profile must trace the step that runs, so the plan of such a Trainer traces its ``compute_loss``."""

from __future__ import annotations

from typing import Any

from torch import nn

from memopt.profile.loss_key import loss_key

__all__ = ["TrainerLoss", "script_loss", "script_step", "trainer_loss"]

#: library steps that only wrap ``Trainer.training_step`` in a context (TRL's activation offload): their batch splits
#: as the Trainer's does
_CONTEXT_ONLY_STEPS = frozenset({"trl.trainer.sft_trainer.SFTTrainer", "trl.trainer.dpo_trainer.DPOTrainer",
                                 "trl.trainer.reward_trainer.RewardTrainer"})


class TrainerLoss:
    """``(model, batch) -> loss`` through the Trainer's ``compute_loss``. ``key`` identifies it for the profile
    cache: the class's ``compute_loss``, the ``compute_loss_func`` and the smoothing factor."""

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer
        smoothing = float(getattr(trainer.args, "label_smoothing_factor", 0.0) or 0.0)
        self.key = (f"{loss_key(type(trainer).compute_loss)}:{loss_key(trainer.compute_loss_func)}:"
                    f"{smoothing:g}")

    def __call__(self, model: nn.Module, batch: Any) -> Any:
        # compute_loss pops the labels out of the dict it is given
        return self._trainer.compute_loss(model, dict(batch))


def script_loss(trainer: Any) -> bool:
    """Whether the script computes the loss itself: a subclass's ``compute_loss``, or a ``compute_loss_func``."""
    from transformers import Trainer

    custom = getattr(type(trainer), "compute_loss", Trainer.compute_loss) is not Trainer.compute_loss
    return custom or getattr(trainer, "compute_loss_func", None) is not None


def trainer_loss(trainer: Any) -> TrainerLoss | None:
    """The Trainer's loss where it differs from the model's own, else None (the profile then traces the model's)."""
    if script_loss(trainer) or getattr(trainer, "label_smoother", None) is not None:
        return TrainerLoss(trainer)
    return None


def script_step(trainer: Any) -> str | None:
    """The name of the script's own ``training_step`` the Trainer runs (a subclass's, or one set on the instance),
    or None where it is the Trainer's. Such a step may backpropagate terms of its own or a loss that is no
    ``compute_loss``'s, which no weighting of micro-batches can reach: it runs on the batches the script gave it."""
    from transformers import Trainer

    if "training_step" in vars(trainer):
        return "the instance's training_step"
    for cls in type(trainer).__mro__:
        if cls is Trainer:
            return None
        if "training_step" in vars(cls) and f"{cls.__module__}.{cls.__qualname__}" not in _CONTEXT_ONLY_STEPS:
            return f"{cls.__qualname__}.training_step"
    return None
