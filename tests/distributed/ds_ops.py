"""Whether DeepSpeed's JIT-compiled CPU ops exist here (scripts/prepare_test_env.sh builds them before the suite)."""

from __future__ import annotations

from pathlib import Path


def op_built(name: str) -> bool:
    """``cpu_adam``, ``async_io``, ...: its shared object is in torch's extension directory."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return (Path(_get_build_directory(name, False)) / f"{name}.so").exists()
    except Exception:
        return False
