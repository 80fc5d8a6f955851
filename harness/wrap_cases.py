"""The wrap validation cases (issue: memopt.wrap proven on the H200): architectures x budgets.

Plans are made on the CPU (``scripts/make_wrap_plans.py``) exactly as a user's dry run makes them, saved
under ``benchmarks/wrap/plans/``, then applied unchanged on the GPU by ``scripts/validate_gpu.py --matrix
wrap`` under the hard cap.
"""

from __future__ import annotations

CASES: list[tuple[str, dict]] = [
    ("llama32_1b", {"batch_size": 8, "seq_len": 2048}),
    ("qwen25_0_5b", {"batch_size": 8, "seq_len": 2048}),
    ("gpt2_medium", {"batch_size": 16, "seq_len": 1024}),
    ("bert_large", {"batch_size": 32, "seq_len": 512}),
    ("vit_large", {"batch_size": 64, "image_size": 224}),
]
BUDGETS = ("12GiB", "24GiB", "40GiB")
HARDWARE = "h200"


def plan_name(model: str, budget: str) -> str:
    return f"{model}_{budget}"
