"""Which kernel bitsandbytes' CUDA 4-bit GEMM runs: a port of its dispatch, pure maths, no bitsandbytes.

The fused kernel allocates only its output; the fallback dequantizes the whole weight into a temporary first.
The estimator's byte maths (``memopt.techniques.quantized_bytes``) and the profiler's stand-ins
(``memopt.profile.quant_gemm_4bit``) both ask the same question, so the answer lives below both.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["GEMM_4BIT_CUSTOM_MAX_M", "gemm_4bit_uses_fused_kernel"]

GEMM_4BIT_CUSTOM_MAX_M = 1536  # backends/cuda/ops.py: past this many rows, dequantize + F.linear
_GEMM_4BIT_CUSTOM_FLOOR_M = 4


@functools.cache
def gemm_4bit_uses_fused_kernel(M: int, N: int, K: int, dtype: torch.dtype, blocksize: int = 64, *,
                                major: int = 9, minor: int = 0, num_sms: int = 132) -> bool:
    """Whether bitsandbytes' CUDA ``gemm_4bit`` takes the fused kernel (no dequantized weight temporary).

    A port of the dispatch in ``bitsandbytes/backends/cuda/ops.py`` (0.50.2): the ``gemm_4bit`` kernel's
    ``M > 1536`` and ``K % blocksize`` checks and ``_gemm_4bit_use_custom_cuda`` (CUDA, not ROCm)."""
    if M > GEMM_4BIT_CUSTOM_MAX_M or K % blocksize != 0:
        return False
    if M <= _GEMM_4BIT_CUSTOM_FLOOR_M:
        return True
    n_blocks = (N + 63) // 64
    if dtype == torch.float32 or major < 7:
        return M < 8
    if major == 7 and (minor < 5 or dtype != torch.float16):
        return M < 8
    if (major == 8 and minor == 7) or major == 11:
        return False
    if major == 10:
        if n_blocks >= num_sms * 3:
            return M <= 32
        if n_blocks >= num_sms:
            return False if K >= N else M <= 8
        return False
    is_sm75 = major == 7 and minor == 5
    is_sm80 = major == 8 and minor == 0
    is_sm86 = major == 8 and minor == 6
    is_sm90 = major == 9
    is_sm120 = major == 12 and minor == 0
    is_sm121 = major == 12 and minor == 1
    is_hbm = is_sm80 or is_sm90
    tall_k_2xn = K > N * 2
    if N * K < 4 * 1024 * 1024:
        if K * 2 < N:
            if is_hbm:
                low_wave = n_blocks * 3 < num_sms
                if is_sm80:
                    cap = 1536 if low_wave else 512
                    return cap >= M
                cap = 512 if low_wave else 320
                return cap >= M
            if is_sm75:
                if n_blocks >= num_sms * 3:
                    return M <= 320
                if K >= 1024:
                    return M <= 64
                if K >= 704:
                    return M <= 96
                return M <= 320
            if n_blocks >= num_sms:
                return M <= 320
            return M <= 192 if n_blocks * K > num_sms * 320 else M <= 320
        quarter_wave = n_blocks * 4 <= num_sms
        if is_sm80 and quarter_wave:
            if K >= N:
                cap = 32 if n_blocks * 8 <= num_sms else 128
                return cap >= M
            return M <= 384
        if is_sm75 and n_blocks < num_sms and M > 8:
            return M <= 64
        if quarter_wave:
            cap = 32 if (K < N or is_hbm) else 23
            return cap >= M
        if n_blocks * 2 <= num_sms:
            return M <= 16
        return False
    if M > 512:
        return False
    if M < 8:
        hbm_m67_thresh = 36 if is_sm90 else 48
        if is_hbm and M >= 6 and n_blocks >= hbm_m67_thresh:
            lt_75pct_wave = n_blocks * 4 < num_sms * 3
            lt_60pct_wave = n_blocks * 5 < num_sms * 3
            if K > N and lt_75pct_wave:
                return False
            if K == N:
                if is_sm80 and lt_60pct_wave:
                    return False
                if is_sm90 and lt_75pct_wave and not lt_60pct_wave:
                    return False
        return True
    if is_sm75:
        if n_blocks >= num_sms * 3:
            cap = 128 if K < N else 64
            return cap >= M
        if n_blocks >= num_sms // 2:
            return M <= 64
        return M <= 32
    if is_sm80:
        if n_blocks >= num_sms * 3:
            return M <= 128
        if n_blocks >= num_sms:
            cap = 64 if K < N else 32
            return cap >= M
        if K >= N * 3 and n_blocks * 4 > num_sms:
            return False
        if K == N and n_blocks >= 48 and n_blocks * 5 < num_sms * 3:
            return False
        if n_blocks * 2 < num_sms:
            if K <= N:
                return M <= 128
            if n_blocks * 3 >= num_sms:
                return False
        if n_blocks >= num_sms // 2 and K < N:
            return M <= 128
        return M <= 16
    if is_sm86:
        if n_blocks >= num_sms:
            return M <= 128
        if n_blocks >= num_sms // 2:
            return M <= 64
        return M <= 16
    if is_sm90:
        if n_blocks >= num_sms * 3:
            return M <= 64
        if n_blocks >= num_sms * 2:
            return M <= 48
        if n_blocks >= num_sms:
            return M <= 32
        if n_blocks >= num_sms // 2:
            if K >= N and n_blocks * 4 < num_sms * 3:
                return False
            return M <= 16
        return False
    if is_sm121 and n_blocks >= num_sms:
        return M <= 256
    if is_sm120:
        if n_blocks >= num_sms * 3:
            return M <= 256
        if n_blocks >= num_sms * 2:
            return M <= 128
        if n_blocks * 5 >= num_sms * 4:
            cap = 96 if K >= N else 64
            return cap >= M
        if n_blocks >= num_sms:
            return M <= 64
        if n_blocks >= num_sms // 2:
            cap = 64 if (K * 2 >= N and n_blocks >= 128) else 8
            return cap >= M
        if tall_k_2xn and n_blocks > 64:
            return M <= 16
        return M <= 8
    if n_blocks >= num_sms * 3:
        return M <= 256
    if n_blocks >= num_sms * 2:
        return M <= 128
    if n_blocks * 5 >= num_sms * 4:
        if tall_k_2xn or n_blocks >= 200:
            return M <= 128
        if K >= N:
            cap = 128 if num_sms >= 60 else 32
            return cap >= M
        return M <= 64
    if n_blocks >= num_sms // 2:
        if tall_k_2xn:
            return M <= 64
        if n_blocks >= 64:
            return M <= 8
        return M <= 32
    if K > N and n_blocks <= 48:
        cap = 12 if K >= N * 3 else 10
        return cap >= M
    cap = 16 if (tall_k_2xn or n_blocks < 48) else 8
    return cap >= M
