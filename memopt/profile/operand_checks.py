"""Operand dtype checks the CUDA kernels make and the fake kernels of a trace do not.

A trace runs meta functions, which compute output shapes and dtypes without the dtype checks of the eager kernels:
a plan whose step the GPU refuses at once (token ids fed to an ``nn.Linear``; a bf16 weight fed an fp32 or fp16
activation) would trace, fit and be chosen, and the user's first step would raise. Each check here raises the
RuntimeError the GPU's kernel would, so the trace fails as the step would, and the planner tells the variant's
failure and picks another.

The rules are those of the CUDA kernels, since plans are for GPUs (CPU kernels accept some mixes CUDA refuses, and
refuse some that CUDA's autocast never produces). Ops under autocast reach the checks after its casts
(``autocast_policy`` applies CUDA's), so an autocast step is judged by the dtypes its kernels really get.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_operands"]

aten = torch.ops.aten

# the two matrix operands of each matmul, by position
_MATMUL_OPERANDS = {aten.mm.default: (0, 1), aten.bmm.default: (0, 1), aten.mv.default: (0, 1),
                    aten.addmm.default: (1, 2), aten.baddbmm.default: (1, 2), aten.addmv.default: (1, 2)}

# each normalization's input and weight-and-bias positions. CUDA's layer_norm and group_norm read their weight and
# bias as the input's element type (layer_norm_kernel.cu, group_norm_kernel.cu); its batch_norm also takes them in
# fp32 for a bf16/fp16 input, the mixed case it has kernels for (its running statistics are dispatched apart, and
# not judged here)
_SAME_DTYPE_NORMS = {aten.native_layer_norm.default: (0, (2, 3)),
                     aten.native_group_norm.default: (0, (1, 2))}
_BATCH_NORMS = {aten.native_batch_norm.default: (0, (1, 2)),
                aten._native_batch_norm_legit.default: (0, (1, 2)),
                aten._native_batch_norm_legit.no_stats: (0, (1, 2)),
                aten._native_batch_norm_legit_no_training.default: (0, (1, 2)),
                aten.cudnn_batch_norm.default: (0, (1, 2))}
_HALF = (torch.bfloat16, torch.float16)


def check_operands(func: Any, args: tuple) -> None:
    """Raise the RuntimeError the CUDA kernel of ``func`` would for these operands' dtypes; nothing where it runs."""
    _check_matmul(func, args)
    _check_norm(func, args)


def _check_matmul(func: Any, args: tuple) -> None:
    at = _MATMUL_OPERANDS.get(func)
    if at is None or len(args) <= max(at):
        return
    a, b = args[at[0]], args[at[1]]
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dtype == b.dtype:
        return
    if a.is_floating_point() != b.is_floating_point():
        raise RuntimeError(f"{func.__name__}: expected both matrices to have the same dtype, but got {a.dtype} and "
                           f"{b.dtype} (an integer tensor, token ids or labels, fed to a float layer such as "
                           "nn.Linear?)")
    if a.is_floating_point():
        raise RuntimeError(f"{func.__name__}: expected both matrices to have the same dtype, but got {a.dtype} and "
                           f"{b.dtype} (activations in another dtype than the weights they meet, outside autocast: "
                           "the batch or the model already in a 16-bit dtype, or an activation cast by the model)")


def _check_norm(func: Any, args: tuple) -> None:
    mixed_ok = func in _BATCH_NORMS
    at = _BATCH_NORMS.get(func) or _SAME_DTYPE_NORMS.get(func)
    if at is None or len(args) <= at[0]:
        return
    x = args[at[0]]
    if not isinstance(x, torch.Tensor):
        return
    params = [args[i] for i in at[1] if i < len(args) and isinstance(args[i], torch.Tensor)]
    kinds = {p.dtype for p in params}
    if kinds <= {x.dtype} or (mixed_ok and x.dtype in _HALF and kinds <= {x.dtype, torch.float32}):
        return
    accepts = "the input's dtype" + (", or float32 for a bfloat16/float16 input" if mixed_ok else "")
    found = ", ".join(sorted(str(k) for k in kinds))
    raise RuntimeError(f"{func.__name__}: a {x.dtype} input with {found} parameters, where the CUDA kernel takes "
                       f"them in {accepts} (an activation cast to another dtype than the norm layer's weights, "
                       "outside autocast, e.g. norm(h.float()) with the weights in 16 bits)")
