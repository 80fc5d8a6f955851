"""Which aten ops launch no GPU kernel: views, metadata queries and allocations without a fill. The step-time
model counts every other op as one kernel launch (``memopt.profile.costs``), and the host-speed probe divides its
host time by the same count (``memopt.host_speed``)."""

from __future__ import annotations

__all__ = ["FREE_OPS"]

FREE_OPS = {"view", "_unsafe_view", "reshape", "transpose", "t", "expand", "slice", "select", "as_strided",
            "permute", "unsqueeze", "squeeze", "detach", "alias", "split", "split_with_sizes", "unbind",
            "empty", "empty_strided", "empty_like", "lift_fresh", "_to_copy_noop", "view_as_real", "view_as_complex",
            "unflatten", "flatten", "narrow", "chunk", "_reshape_alias", "diagonal", "squeeze_", "unsqueeze_",
            "is_same_size", "_local_scalar_dense", "is_nonzero", "sym_size", "sym_stride", "sym_numel",
            # metadata queries that reach the dispatcher in a fake trace (``prim::device``: 3 of 4 traced ops of a
            # decoder block) but launch nothing on a GPU: counted, they made the kernel count 4x too high
            "device", "sym_storage_offset", "is_contiguous", "is_strides_like_format", "is_non_overlapping_and_dense"}
