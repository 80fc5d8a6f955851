#!/usr/bin/env bash
# Session 9, fourth GPU run (nvidia-h200, carrying .whl). Qwen2-1.5B, 8 x 2048, 12 GiB budget:
# 1. the hand-written DeepSpeed ZeRO-3 full-offload baseline at the same budget as memopt: its allocator capped at
#    the budget less what a DeepSpeed process holds outside the allocator (1.79 GB measured: 10.33 GiB);
# 2. an experiment: memopt's plan with DeepSpeed's stage3_max_reuse_distance at 0 (gathered parameters released
#    after each use, as FSDP2 reshards after forward and as memopt's time model already charges), with the
#    allocator history; the same for the Llama-3.2-3B 16 GiB ZeRO-3 plan.
# Usage on the GPU host: bash benchmarks/sharding/session9_gpu_d.sh   (results: $OUT/session9_d.tgz)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site TRANSFORMERS_VERBOSITY=error
R=/tmp/s9d; mkdir -p $R
python3 -c "import sys;sys.path.insert(0,'scripts');from pathlib import Path;from validate_sharding_gpu import prebuild_deepspeed_ops as p;print(p(Path('$R/prebuild.log')))" > $R/prebuild.out 2>&1
timeout 230 python3 scripts/validate_sharding_gpu.py --model qwen2_1_5b --cap-gib 10.33 --cases baseline_zero3_offload --steps 4 \
  --no-prebuild --out $R/base_q15_fair > $R/base_q15_fair.log 2>&1; echo "base rc=$?"; grep -h "\[done\]" $R/base_q15_fair.log | cut -c1-300
one() {  # name plan timeout steps
  timeout $3 torchrun --standalone --nproc-per-node 1 scripts/wrap_sharded_gpu.py run --history --plan benchmarks/sharding/plans/$2 \
    --out $R/$1 --steps $4 --ds-zero stage3_max_reuse_distance=0 > $R/$1.log 2>&1; echo "$1 rc=$?"
  grep -h '^{"plan"' $R/$1.log | cut -c1-700
}
one q15_reuse0 s9_qwen2_1_5b_12GiB.json 150 4
one z3_3b_reuse0 s9_llama32_3b_16GiB_zero3_offload.json 170 3
cd /tmp && tar czf $OUT/session9_d.tgz s9d && ls -la $OUT
