"""The FLOPs a mixture-of-experts' grouped GEMMs are priced at, against the count by hand: 2 x m x n x k for every
product, the expert groups splitting one of the dimensions between them."""

from __future__ import annotations

import torch

from memopt.profile.costs import CostRecorder

GROUPED_MM = torch.ops.aten._grouped_mm.default


def _flops(a_shape, b_shape, out_shape) -> float:
    costs = CostRecorder(lambda: 0)
    a = torch.empty(a_shape, dtype=torch.bfloat16, device="meta")
    b = torch.empty(b_shape, dtype=torch.bfloat16, device="meta")
    costs(GROUPED_MM, (a, b), torch.empty(out_shape, dtype=torch.bfloat16, device="meta"))
    return costs.costs[0].matmul_flops["bf16"]


def test_grouped_gemm_flops_by_hand():
    experts, tokens, hidden, inter = 60, 32768, 2048, 1408
    # forward: every routed token's rows times its expert's weight (tokens x hidden) x (experts, hidden, inter)
    assert _flops((tokens, hidden), (experts, hidden, inter), (tokens, inter)) == 2 * tokens * hidden * inter
    # the weight gradient: (hidden, tokens) x (tokens, inter), the tokens split among the experts. It was counted
    # 2 x experts x hidden x inter x hidden: 3.75x too many here, and 6-9x the backward of a Qwen2-MoE step
    assert _flops((hidden, tokens), (tokens, inter), (experts, hidden, inter)) == 2 * hidden * inter * tokens
    # batched per expert: (experts, m, k) x (experts, k, n)
    batched = _flops((experts, 64, hidden), (experts, hidden, inter), (experts, 64, inter))
    assert batched == 2 * experts * 64 * hidden * inter
