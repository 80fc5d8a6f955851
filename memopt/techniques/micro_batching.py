"""Micro-batching: the global batch split along dim 0 into ``micro_batch_size`` samples per forward and backward,
the gradients accumulated exactly (``memopt.step.train_step``). The split is exact only where a sample's loss and
gradients do not depend on the other samples of its forward: BatchNorm in training normalizes with the statistics of
the batch it sees, so on a micro-batch it computes other activations and updates its running statistics more often.
Such a model is not micro-batched unless the user pins a micro-batch size (the plan and ``memopt.wrap`` say so).
"""

from __future__ import annotations

from torch import nn

__all__ = ["batch_coupled_modules", "micro_batch_refusal"]


def batch_coupled_modules(model: nn.Module) -> list[str]:
    """The modules whose training forward mixes the samples of a batch (BatchNorm and its subclasses)."""
    return [name or "(root)" for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def micro_batch_refusal(model: nn.Module) -> str | None:
    """Why splitting a batch into micro-batches would not be exact for ``model`` (None: it would be)."""
    names = batch_coupled_modules(model)
    if not names:
        return None
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (f"its BatchNorm layers ({shown}) normalize with the statistics of the batch they see, so micro-batches "
            "would change training")
