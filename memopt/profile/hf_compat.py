"""Keeping Hugging Face models on the GPU's code path while they run on fake tensors.

``transformers`` treats fake tensors as "tracing" (as under ``torch.export``) and then refuses the
fast paths it takes on a real GPU: it materializes a causal mask instead of passing ``is_causal``,
which changes the attention kernel (flash cannot take a mask) and adds a batch x 1 x L x L mask.
While a trace runs, its mask utilities see fake tensors as ordinary tensors again; boolean checks on
them (``mask.all()``) are answered by the tracker (unpadded, unpacked batches).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["real_code_paths"]


@contextlib.contextmanager
def real_code_paths() -> Iterator[None]:
    module = sys.modules.get("transformers.masking_utils")
    if module is None or not hasattr(module, "is_tracing"):
        yield
        return
    original = module.is_tracing

    def is_tracing(tensor: Any = None) -> bool:
        return original(None)  # dynamo / jit / stream capture only; fake tensors are not "tracing" here

    module.is_tracing = is_tracing
    try:
        yield
    finally:
        module.is_tracing = original
