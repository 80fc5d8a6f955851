"""Which CUDA attention kernel ``scaled_dot_product_attention`` would run, decided on CPU (fake) tensors.

``choose_backend`` follows ``select_sdp_backend`` of ``sdp_utils.cpp`` for dense inputs: the priority order, the
user's enable flags (``torch.nn.attention.sdpa_kernel``), dtype, head-dim, mask, causal, GQA and hardware
constraints. What the chosen kernel allocates is ``memopt.profile.attention_kernels``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BACKENDS", "AttentionPolicy", "UnsupportedAttention", "choose_backend", "round_up"]

BACKENDS = ("flash", "efficient", "cudnn", "math")
_ENUM_TO_NAME = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}


@dataclass(frozen=True, kw_only=True)
class AttentionPolicy:
    """The facts of the target CUDA stack that decide attention kernels and their scratch memory."""

    sm: int = 90
    prefer_cudnn: bool = False  # recent torch + cuDNN >= 9.15 on sm90/100 put cuDNN attention first
    has_flash: bool = True
    has_efficient: bool = True
    has_cudnn: bool = True
    # flash-attention backward scratch: dq accumulator in fp32 over rounded shapes, softmax_d in fp32
    flash_bwd_dq_accum: bool = True
    flash_round_q: int = 128
    flash_round_d: int = 32
    efficient_lse_pad: int = 32


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _enabled(name: str) -> bool:
    return {
        "flash": torch.backends.cuda.flash_sdp_enabled,
        "efficient": torch.backends.cuda.mem_efficient_sdp_enabled,
        "cudnn": torch.backends.cuda.cudnn_sdp_enabled,
        "math": torch.backends.cuda.math_sdp_enabled,
    }[name]()


def _priority(policy: AttentionPolicy) -> list[str]:
    order = [_ENUM_TO_NAME[i] for i in torch._C._get_sdp_priority_order() if i in _ENUM_TO_NAME]
    if policy.prefer_cudnn and order[:3] == ["flash", "efficient", "math"]:
        order = ["cudnn", "flash", "efficient", "math"]
    return order


def _can_use(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
             dropout_p: float, is_causal: bool, enable_gqa: bool, policy: AttentionPolicy) -> bool:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return name == "math"
    dtype = q.dtype
    half = dtype in (torch.float16, torch.bfloat16)
    d_qk, d_v = q.shape[-1], v.shape[-1]
    lq, lk = q.shape[-2], k.shape[-2]
    hq, hk = q.shape[1], k.shape[1]
    if lq == 0 or lk == 0:
        return name == "math"
    heads_ok = hq == hk or (hq % hk == 0 and enable_gqa)
    if name == "math":
        return True
    if mask is not None and mask.shape[-1] != 1 and mask.stride(-1) != 1:
        return False  # fused kernels need the mask's last dim dense (T5's permuted position bias runs math)
    if mask is not None and mask.requires_grad and name != "efficient":
        # only the memory-efficient kernel differentiates its bias (Swin's and T5's learned position biases);
        # flash takes no mask and cuDNN refuses one that needs a gradient (H200, torch 2.11, measured)
        return False
    if name == "flash":
        if not policy.has_flash or policy.sm < 80 or not half or mask is not None:
            return False
        if not (d_qk == k.shape[-1] == d_v and d_qk <= 256):
            return False
        if is_causal and lq != lk:
            return False
        if policy.sm in (86, 89, 120) and d_qk > 192 and q.requires_grad:
            return False
        return heads_ok and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    if name == "efficient":
        if not policy.has_efficient:
            return False
        if dtype == torch.bfloat16 and policy.sm < 80:
            return False
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return False
        align = 8 if half else 4 if policy.sm >= 80 else 1
        if d_qk != k.shape[-1] or d_qk % align or d_v % align:
            return False
        if hq != hk:  # torch 2.11's memory-efficient kernel takes no grouped-query attention (measured)
            return False
        return q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    if name == "cudnn":
        if not policy.has_cudnn or policy.sm < 80 or policy.sm > 121 or not half:
            return False
        if torch.are_deterministic_algorithms_enabled():
            return False
        if d_qk > 128 and not (d_qk == 256 and policy.sm >= 90):
            return False
        if d_qk % 8 or d_v % 8:
            return False
        return heads_ok
    return False


class UnsupportedAttention(ValueError):
    """The attention backends allowed cannot run these inputs (as CUDA would refuse them)."""


def choose_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   dropout_p: float, is_causal: bool, enable_gqa: bool, policy: AttentionPolicy) -> str:
    """The backend CUDA's ``select_sdp_backend`` would pick for these inputs on ``policy.sm``."""
    for name in _priority(policy):
        if _enabled(name) and _can_use(name, q, k, v, mask, dropout_p, is_causal, enable_gqa, policy):
            return name
    raise UnsupportedAttention("no enabled scaled_dot_product_attention backend takes these inputs on "
                               f"sm{policy.sm} (dtype {q.dtype}, head dim {q.shape[-1]}, "
                               f"{'mask, ' if mask is not None else ''}{q.shape[1]}/{k.shape[1]} heads)")
