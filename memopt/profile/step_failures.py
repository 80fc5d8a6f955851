"""What a failure of the model's own step under a variant means for the user, where torch's message does not say.

The planner reports the failure as the reason the variant's candidates are refused; these explanations turn the
known causes into the fix."""

from __future__ import annotations

__all__ = ["describe_step_failure"]

# (a fragment of torch's message, what it means here)
_KNOWN: tuple[tuple[str, str], ...] = (
    ("aten._local_scalar_dense",
     "the step reads the value of an integer tensor computed from the model's activations (`.item()`, `int()` of "
     "a tensor) to make a size or an index, which a trace on fake tensors cannot know; compute it from the batch's "
     "own integer tensors (their values are traced), or outside the training step"),
    ("Tensor cached during selective activation checkpoint has been mutated",
     "selective checkpointing keeps every matmul's output for backward, and this model changes one in place after "
     "it is made (an nn.ReLU(inplace=True) or an `x += ...` on a Linear's output), so its recomputation would not "
     "be exact: selective checkpointing is refused for this model; full checkpointing is not affected, and "
     "making that op out of place (inplace=False, `x = x + ...`) allows selective"),
)


def describe_step_failure(exc: BaseException) -> str:
    """One line: the error's type and first line, and what it means where memopt knows."""
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    said = f"{type(exc).__name__}: {first}"
    for fragment, meaning in _KNOWN:
        if fragment in str(exc):
            return f"{said}; {meaning}"
    return said
