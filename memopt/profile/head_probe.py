"""The probe behind a fused head + loss's refusal: one forward of a one-block fake copy of a causal LM (no memory,
no values) that checks the aten ops between its head and its loss are exactly the transform its config declares
(``memopt.techniques.lm_head``), applied to the head's output and feeding the loss, and nothing else."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from memopt.models.hf_task import peft_unwrapped
from memopt.profile.fake_model import fake_copy
from memopt.profile.hf_compat import grouped_mm_in_any_float, real_code_paths
from memopt.profile.process_caches import caches_kept_real
from memopt.profile.tracker import MemoryTracker
from memopt.techniques.lm_head import HeadTransform, head_transform, static_head_refusal

__all__ = ["head_refusal"]


class _OpLog(TorchDispatchMode):
    """The aten ops run while ``on``: name, the scalar argument (if any), the tensor input and the output."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False
        self.ops: list[tuple[str, float | None, Any, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.on:
            scalar = next((a for a in args[1:] if isinstance(a, (int, float)) and not isinstance(a, bool)), None)
            self.ops.append((str(func), None if scalar is None else float(scalar), args[0] if args else None, out))
        return out


def _same(a: Any, b: Any) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and a.untyped_storage()._cdata == b.untyped_storage()._cdata)


def _probe_refusal(model: nn.Module, transform: HeadTransform) -> str | None:
    """Run the model's forward once on a one-block fake copy and check that its loss is exactly the standard
    causal-LM cross-entropy of ``transform(lm_head(base_model(...).last_hidden_state))``, nothing else."""
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return "transformers' causal-LM loss is not available to compare with"
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    clone = fake_copy(model, mode, "cpu", keep_blocks=1)
    seen: dict[str, Any] = {"loss_calls": []}
    log = _OpLog()

    def spy(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, **kwargs: Any) -> torch.Tensor:
        log.on = False
        out = ForCausalLMLoss(logits, labels, vocab_size, **kwargs)
        seen["loss_calls"].append((logits, out, sorted(k for k, v in kwargs.items() if v is not None)))
        return out

    def head_hook(m: nn.Module, a: Any, o: Any) -> None:
        seen.update(head_in=a[0], head_out=o)
        log.ops.clear()
        log.on = True

    head = clone.get_output_embeddings()
    hooks = [head.register_forward_hook(head_hook),
             clone.base_model.register_forward_hook(lambda m, a, o: seen.update(base_out=o))]
    clone.loss_function = spy
    try:
        # the tracker answers the boolean checks models make on masks (fake tensors have no values)
        # grouped-GEMM experts run in fp32 here, as the trace runs them
        with (caches_kept_real(model), mode, real_code_paths(), grouped_mm_in_any_float(), torch.no_grad(),
              MemoryTracker("cpu", record=False), log):
            ids = torch.zeros(1, 4, dtype=torch.long)
            out = clone(input_ids=ids, labels=ids, use_cache=False)
    except Exception as exc:  # any failure: the structure could not be verified
        return f"its head could not be checked ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
    finally:
        for h in hooks:
            h.remove()

    name = type(model).__name__
    hidden = getattr(seen.get("base_out"), "last_hidden_state", None)
    calls = seen["loss_calls"]
    if "head_out" not in seen or not _same(seen["head_in"], hidden):
        return f"{name}'s head does not take the base model's last hidden state unchanged"
    if len(calls) != 1:
        return f"{name} changes the logits between its head and its loss"
    ran = [(op, scalar) for op, scalar, _, _ in log.ops]
    chained = all(_same(inp, prev) for (_, _, inp, _), prev in
                  zip(log.ops, [seen["head_out"]] + [o for _, _, _, o in log.ops]))
    last = log.ops[-1][3] if log.ops else seen["head_out"]
    if ran != transform.expected_ops() or not chained or not _same(calls[0][0], last):
        return f"{name} changes the logits between its head and its loss"
    if getattr(out, "loss", None) is not calls[0][1]:
        return f"{name}'s loss is more than the cross-entropy of its logits"
    extra = [k for k in calls[0][2] if k not in ("num_items_in_batch",)]
    if extra:
        return f"{name} passes {extra} to its loss"
    return None


def head_refusal(model: nn.Module, *, probe: bool = True) -> str | None:
    """Why a fused head + loss would not be exact for ``model`` (None: it is, with ``head_transform(model)``).
    Exact means the model's own loss is the standard causal-LM cross-entropy of the transformed
    ``base_model(...).last_hidden_state @ lm_head.weight.T``: no head bias, auxiliary loss or custom loss, and no
    transform but a declared scale or softcap. ``probe`` also runs a one-block fake copy to check that structure."""
    model = peft_unwrapped(model)
    reason = static_head_refusal(model)
    if reason is None and probe:
        transform = head_transform(model)
        assert isinstance(transform, HeadTransform)
        reason = _probe_refusal(model, transform)
    return reason
