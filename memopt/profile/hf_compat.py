"""Keeping Hugging Face models on the GPU's code path while they run on fake tensors.

``transformers`` treats fake tensors as "tracing" (as under ``torch.export``) and then refuses the
fast paths it takes on a real GPU: it materializes a causal mask instead of passing ``is_causal``,
which changes the attention kernel (flash cannot take a mask) and adds a batch x 1 x L x L mask.
While a trace runs, its mask utilities see fake tensors as ordinary tensors again; boolean checks on
them (``mask.all()``) are answered by the tracker (unpadded, unpacked batches).

Their grouped-GEMM experts call ``_grouped_mm`` in fp32, which CUDA's kernel runs but PyTorch's meta function
refuses: ``grouped_mm_in_any_float`` gives fake tensors the kernel's answer.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.library import Library

__all__ = ["grouped_mm_in_any_float", "real_code_paths"]


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


def _grouped_mm_meta(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Output of CUDA's grouped GEMM for any float dtype (PyTorch's meta function admits only bf16, while the
    CUDA kernel of torch >= 2.10 also runs fp32, as transformers' MoE experts do under autocast)."""
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    if a2 and b2:
        size = [offs.size(0), mat_a.size(0), mat_b.size(1)]
    elif a2:
        size = [mat_a.size(0), mat_b.size(-1)]
    elif b2:
        size = [mat_a.size(1), mat_b.size(1)]
    else:
        size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    dtype = out_dtype or mat_a.dtype
    align = 16 // dtype.itemsize
    padded = -(-size[-1] // align) * align
    stride = [size[1] * padded, padded, 1] if a2 == b2 else [padded, 1]
    return torch.empty_strided(size, stride, dtype=dtype, device=mat_a.device)


@contextlib.contextmanager
def grouped_mm_in_any_float() -> Iterator[None]:
    """``_grouped_mm`` on fake tensors of any float dtype, as its CUDA kernel runs them (PyTorch's meta function
    admits only bf16: transformers' grouped-GEMM experts in fp32 could not be traced at all)."""
    lib = Library("aten", "IMPL")
    with contextlib.ExitStack() as stack:
        # torch <= 2.12 registers _grouped_mm's meta function from Python and refuses a second Python kernel for the
        # same key (later versions override by default): step aside its bookkeeping while ours is registered; the
        # dispatcher itself stacks the kernels and restores the original when ours is destroyed
        registered = getattr(torch.library, "_impls", set())
        key = "aten/_grouped_mm/Meta"
        if key in registered:
            registered.discard(key)
            stack.callback(registered.add, key)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel" is what we mean
            lib.impl("_grouped_mm", _grouped_mm_meta, "Meta")
        stack.callback(lib._destroy)
        yield
