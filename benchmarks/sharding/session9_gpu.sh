#!/usr/bin/env bash
# Session 9 GPU run (nvidia-h200, carrying .whl): the current plans applied by memopt.wrap under the hard cap that
# wrap sets (budget - predicted outside-allocator bytes): DeepSpeed ZeRO-3 with optimizer and parameters on the CPU
# for llama32_3b (16 GiB) and llama32_1b (12 GiB) with the allocator history (per-stream peaks and the sizes live
# there), then the planner's own ZeRO-2 + optimizer-offload plans for the same two cases.
# Usage on the GPU host: bash benchmarks/sharding/session9_gpu.sh   (results: $OUT/session9.tgz)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site TRANSFORMERS_VERBOSITY=error
R=/tmp/s9; mkdir -p $R
P=benchmarks/sharding/plans
python3 -c "import sys;sys.path.insert(0,'scripts');from pathlib import Path;from validate_sharding_gpu import prebuild_deepspeed_ops as p;print(p(Path('$R/prebuild.log')))" > $R/prebuild.out 2>&1
one() {  # name plan timeout [extra]
  timeout $3 torchrun --standalone --nproc-per-node 1 scripts/wrap_sharded_gpu.py run --plan $P/$2 --out $R/$1 --steps 3 $4 \
    > $R/$1.log 2>&1; echo "$1 rc=$?"
  grep -h '^{"plan"' $R/$1.log | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print({k: r.get(k) for k in ('plan','measured_peak_allocated_bytes','predicted_peak_allocated_bytes','measured_peak_reserved_bytes','predicted_peak_reserved_bytes','wrap_cap_bytes','num_alloc_retries','measured_outside_allocator_bytes','measured_total_bytes','budget_bytes','measured_step_s','predicted_step_s','reserved_by_stream')})"
}
one z3_3b s9_llama32_3b_16GiB_zero3_offload.json 150 --history
one z2_3b s9_llama32_3b_16GiB_offload.json 130
one z2_1b s9_llama32_1b_12GiB_offload.json 90
one z3_1b s9_llama32_1b_12GiB_zero3_offload.json 100 --history
cd /tmp && tar czf $OUT/session9.tgz s9 && ls -la $OUT
