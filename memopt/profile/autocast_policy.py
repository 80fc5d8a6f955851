"""CUDA's autocast policy, applied to CPU (fake) tensors.

CPU autocast and CUDA autocast cast different ops (CPU keeps ``pow`` in bf16, CUDA runs it in fp32;
CPU casts ``cross_entropy_loss`` to fp32 as a whole, CUDA casts its ``log_softmax`` and ``nll_loss``),
so a CPU trace under ``torch.autocast('cpu')`` allocates different bytes than the GPU run. While
``cuda_autocast_policy()`` is active, every op that CUDA's autocast handles gets a CPU autocast kernel
with CUDA's policy, and every op that only CPU's autocast handles gets a pass-through kernel.

The op *set* comes from the dispatcher (the ops with an ``AutocastCUDA`` kernel in the installed
torch); the policy of each op comes from ``ATen/autocast_mode.h`` of PyTorch 2.11 (the tables below).
The registrations are scoped: leaving the context removes them, restoring CPU autocast exactly.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.library import Library

__all__ = ["CUDA_POLICY", "cuda_autocast_policy"]

# op name (with overload, "" = default) -> policy, from ATen/autocast_mode.h
_LOWER = """_convolution.deprecated _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d.input
conv_transpose3d.input convolution prelu addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm baddbmm bmm
chain_matmul linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell
_scaled_dot_product_flash_attention scaled_dot_product_attention cudnn_convolution cudnn_convolution_transpose"""
_FP32 = """acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow.Tensor_Scalar
pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm rms_norm group_norm frobenius_norm.dim nuclear_norm
nuclear_norm.dim
cosine_similarity poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div l1_loss
smooth_l1_loss huber_loss mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss triplet_margin_loss
multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp upsample_nearest1d
_upsample_nearest_exact1d upsample_nearest2d _upsample_nearest_exact2d upsample_nearest3d _upsample_nearest_exact3d
upsample_linear1d upsample_bilinear2d _upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d
_upsample_bicubic2d_aa"""
_FP32_SET_OPT_DTYPE = """prod prod.dim_int softmax.int log_softmax.int cumprod cumsum linalg_vector_norm
linalg_matrix_norm linalg_matrix_norm.str_ord sum sum.dim_IntList"""
_PROMOTE = "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add"
_FP32_APPEND_DTYPE = {"norm.Scalar": "ScalarOpt_dtype", "norm.ScalarOpt_dim": "ScalarOpt_dim_dtype"}

CUDA_POLICY: dict[str, str] = {}
for _policy, _names in (("lower", _LOWER), ("fp32", _FP32), ("fp32_set_opt_dtype", _FP32_SET_OPT_DTYPE),
                        ("promote", _PROMOTE)):
    for _name in _names.split():
        CUDA_POLICY[_name] = _policy
for _name in _FP32_APPEND_DTYPE:
    CUDA_POLICY[_name] = "fp32_append_dtype"

_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
_AFTER_AUTOCAST_CPU = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.AutocastCPU)


def _split(qualified: str) -> tuple[str, str]:
    name = qualified.removeprefix("aten::")
    base, _, overload = name.partition(".")
    return base, overload or "default"


def _overload(qualified: str) -> torch._ops.OpOverload | None:
    base, overload = _split(qualified)
    packet = getattr(torch.ops.aten, base, None)
    return getattr(packet, overload, None) if packet is not None else None


def _eligible(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 and t.device.type == "cpu"


class _CastCache:
    """Autocast's weight-cast cache: lower-precision copies of fp32 leaf tensors that require grad."""

    def __init__(self) -> None:
        self._casts: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def cast(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        cacheable = t.dtype == torch.float32 and t.requires_grad and t.is_leaf and not t._is_view()
        if not cacheable:
            return t.to(dtype)
        hit = self._casts.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        out = t.to(dtype)
        self._casts[id(t)] = (weakref.ref(t), out)
        return out

    def clear(self) -> None:
        self._casts.clear()


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(fn(v) if isinstance(v, torch.Tensor) else v for v in value)
    return value


def _kernel(op: torch._ops.OpOverload, policy: str, cache: _CastCache) -> Callable[..., Any]:
    schema_args = [a.name for a in op._schema.arguments]
    dtype_pos = schema_args.index("dtype") if "dtype" in schema_args else None

    def run(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            return op(*args, **kwargs)

    if policy == "passthrough":
        # Like a fallthrough: ops called inside this one (a composite such as cross_entropy_loss)
        # still see autocast, as they do on CUDA where this op has no autocast kernel at all.
        def passthrough(keyset: torch._C.DispatchKeySet, *args: Any, **kwargs: Any) -> Any:
            return op.redispatch(keyset & _AFTER_AUTOCAST_CPU, *args, **kwargs)
        return passthrough

    if policy == "lower":
        def lower(*args: Any, **kwargs: Any) -> Any:
            dtype = torch.get_autocast_dtype("cpu")

            def cast(t: torch.Tensor) -> torch.Tensor:
                return cache.cast(t, dtype) if _eligible(t) and t.dtype != dtype else t

            args = tuple(_map_tensors(a, cast) for a in args)
            kwargs = {k: _map_tensors(v, cast) for k, v in kwargs.items()}
            return run(*args, **kwargs)
        return lower

    if policy == "fp32":
        def fp32(*args: Any, **kwargs: Any) -> Any:
            def cast(t: torch.Tensor) -> torch.Tensor:
                return t.to(torch.float32) if _eligible(t) and t.dtype != torch.float32 else t

            args = tuple(_map_tensors(a, cast) for a in args)
            kwargs = {k: _map_tensors(v, cast) for k, v in kwargs.items()}
            return run(*args, **kwargs)
        return fp32

    if policy == "fp32_set_opt_dtype":
        def set_opt_dtype(*args: Any, **kwargs: Any) -> Any:
            if args and _eligible(args[0]):
                if dtype_pos is not None and dtype_pos < len(args):
                    if args[dtype_pos] is None:
                        args = (*args[:dtype_pos], torch.float32, *args[dtype_pos + 1:])
                elif kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
            return run(*args, **kwargs)
        return set_opt_dtype

    if policy == "promote":
        def promote(*args: Any, **kwargs: Any) -> Any:
            floats = [t for t in torch.utils._pytree.tree_flatten((args, kwargs))[0] if _eligible(t)]
            if floats:
                widest = floats[0].dtype
                for t in floats[1:]:
                    widest = torch.promote_types(widest, t.dtype)

                def cast(t: torch.Tensor) -> torch.Tensor:
                    return t.to(widest) if _eligible(t) and t.dtype != widest else t

                args = tuple(_map_tensors(a, cast) for a in args)
                kwargs = {k: _map_tensors(v, cast) for k, v in kwargs.items()}
            return run(*args, **kwargs)
        return promote

    raise AssertionError(f"unknown autocast policy {policy}")


def _append_dtype_kernel(op_with_dtype: torch._ops.OpOverload, plain: torch._ops.OpOverload) -> Callable[..., Any]:
    def norm(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            if args and _eligible(args[0]):
                return op_with_dtype(*args, dtype=torch.float32, **kwargs)
            return plain(*args, **kwargs)
    return norm


@contextlib.contextmanager
def cuda_autocast_policy() -> Iterator[None]:
    """Within this context, ``torch.autocast('cpu', dtype)`` casts exactly what CUDA autocast would."""
    names = torch._C._dispatch_get_all_op_names()
    cuda_ops = {n for n in names if n.startswith("aten::")
                and torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastCUDA")}
    cpu_ops = {n for n in names if n.startswith("aten::")
               and torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastCPU")}
    cache = _CastCache()
    lib = Library("aten", "IMPL")
    original_clear = torch.clear_autocast_cache

    def clear_both() -> None:
        cache.clear()
        original_clear()

    try:
        for qualified in sorted(cuda_ops | cpu_ops):
            name = qualified.removeprefix("aten::")
            key = name
            op = _overload(qualified)
            if op is None:
                continue
            policy = CUDA_POLICY.get(key) if qualified in cuda_ops else "passthrough"
            if policy is None:
                policy = "passthrough"  # an op CUDA autocasts that our table does not know: leave it alone
            if policy == "fp32_append_dtype":
                base, _ = _split(qualified)
                with_dtype = getattr(getattr(torch.ops.aten, base), _FP32_APPEND_DTYPE[key])
                kernel = _append_dtype_kernel(with_dtype, op)
            else:
                kernel = _kernel(op, policy, cache)
            lib.impl(name, kernel, "AutocastCPU", with_keyset=policy == "passthrough")
        torch.clear_autocast_cache = clear_both
        yield
    finally:
        torch.clear_autocast_cache = original_clear
        cache.clear()
        lib._destroy()
