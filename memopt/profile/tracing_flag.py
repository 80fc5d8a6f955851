"""Whether memopt is tracing the training step right now: on fake tensors that hold no values.

A profile runs the user's model, loss and hooks on fake tensors (``memopt.profile.trace``), so that their memory is
counted. Code of the user's that keeps what it sees (a forward hook that collects features, a running log of the
loss) would keep fake tensors; it can ask ``memopt.is_tracing()`` and skip. The flag is per thread and nests.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["is_tracing", "tracing"]

_state = threading.local()


def is_tracing() -> bool:
    """True while memopt runs the model on fake tensors to trace its step (its values are not real)."""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def tracing() -> Iterator[None]:
    """Marks the enclosed code as memopt's trace (see :func:`is_tracing`)."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1
