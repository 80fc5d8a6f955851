#!/usr/bin/env bash
# The session-9 table (benchmarks/sharding/sharding_h200_s9.md/.json) from the rows in raw/session9, each re-predicted
# by today's estimator. Run from the repository root on any machine.
R=benchmarks/sharding/raw/session9 P=benchmarks/sharding/plans
python scripts/report_wrap_sharded.py --out benchmarks/sharding/sharding_h200_s9 \
  --plan-row $P/s9_llama32_3b_16GiB_offload.json=$R/z2_3b/rank0.json \
  --plan-row $P/s9_llama32_3b_16GiB_zero3_offload.json=$R/z3_3b/rank0.json \
  --plan-row $P/s9_llama32_3b_16GiB_zero3_offload.json=$R/z3_3b_reuse0/rank0.json \
  --plan-row $P/s9_llama32_1b_12GiB_offload.json=$R/z2_1b/rank0.json \
  --plan-row $P/s9_llama32_1b_12GiB_zero3_offload.json=$R/z3_1b/rank0.json \
  --plan-row $P/s9_qwen2_1_5b_12GiB_zero2.json=$R/q15_z2/rank0.json \
  --plan-row $P/s9_qwen2_1_5b_12GiB.json=$R/q15/rank0.json \
  --plan-row $P/s9_qwen2_1_5b_12GiB.json=$R/q15_reuse0/rank0.json \
  --case-row benchmarks/wrap/raw/session8/base_z3/baseline_zero3_offload.mb2.rank0.json \
  --case-row $R/base_q15/baseline_zero3_offload.mb2.rank0.json \
  --case-row $R/base_q15_fair/baseline_zero3_offload.mb1.rank0.json \
  --budget base_z3=16GiB --budget base_q15=12GiB --budget base_q15_fair=12GiB \
  --speed z2_3b=base_z3 --speed z3_3b=base_z3 --speed q15=base_q15_fair --speed q15_reuse0=base_q15_fair \
  --speed q15=base_q15 --speed q15_z2=base_q15_fair --speed q15_z2=base_q15
