"""The static facts a profile records of a model without tracing it: every distinct parameter's size, dtype and
whether it trains, the buffers, the parameter bytes by top-level module and dtype, and the block stacks (their path,
length, block class and parameters per block). The planner's state floors and the profile summary read them.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from memopt.blocks import find_block_stacks

__all__ = ["static_facts"]


def static_facts(model: nn.Module) -> dict[str, Any]:
    seen: set[int] = set()
    param_sizes: list[tuple[int, str, bool]] = []
    by_module: dict[str, dict[str, int]] = {}
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        dtype = str(p.dtype).removeprefix("torch.")
        param_sizes.append((p.numel(), dtype, p.requires_grad))
        top = name.split(".")[0] if "." in name else "(root)"
        entry = by_module.setdefault(top, {})
        entry[dtype] = entry.get(dtype, 0) + p.numel() * p.element_size()
    buffers = [(b.numel(), str(b.dtype).removeprefix("torch.")) for b in model.buffers()]
    stacks = []
    for s in find_block_stacks(model):
        block = s.blocks[0]
        stacks.append({"path": s.path, "num_blocks": len(s), "block_class": s.block_class,
                       "params_per_block": sum(p.numel() for p in block.parameters()),
                       "uniform_tail": s.uniform_tail})
        by_dtype: dict[str, int] = {}
        for p in block.parameters():
            d = str(p.dtype).removeprefix("torch.")
            by_dtype[d] = by_dtype.get(d, 0) + p.numel() * p.element_size()
        by_module[f"{s.path}[*] ({s.block_class}, each)"] = by_dtype
    return {"param_sizes": param_sizes, "buffer_sizes": buffers, "params_by_module": by_module, "stacks": stacks,
            "num_params": sum(n for n, _, _ in param_sizes),
            "num_trainable_params": sum(n for n, _, g in param_sizes if g)}
