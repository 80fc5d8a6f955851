#!/usr/bin/env bash
# Session 9, third GPU run (nvidia-h200, carrying .whl): a model no constant was fitted on. Qwen2-1.5B full
# fine-tuning, global batch 8 x 2048, budget 12 GiB: the planner's own plan (DeepSpeed ZeRO-3, optimizer and
# parameters on the CPU) applied by memopt.wrap with the allocator history, then the hand-written DeepSpeed ZeRO-3
# full-offload baseline (default buckets, HF checkpointing, largest micro-batch that fits) under an 11.25 GiB
# allocator cap (the budget less 0.75 GiB, as the session-8 baseline at 16 GiB).
# Usage on the GPU host: bash benchmarks/sharding/session9_gpu_c.sh   (results: $OUT/session9_c.tgz)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site TRANSFORMERS_VERBOSITY=error
R=/tmp/s9c; mkdir -p $R
python3 -c "import sys;sys.path.insert(0,'scripts');from pathlib import Path;from validate_sharding_gpu import prebuild_deepspeed_ops as p;print(p(Path('$R/prebuild.log')))" > $R/prebuild.out 2>&1
timeout 200 torchrun --standalone --nproc-per-node 1 scripts/wrap_sharded_gpu.py run --history \
  --plan benchmarks/sharding/plans/s9_qwen2_1_5b_12GiB.json --out $R/q15 --steps 4 > $R/q15.log 2>&1
echo "q15 rc=$?"; grep -h '^{"plan"' $R/q15.log | cut -c1-1200
timeout 260 python3 scripts/validate_sharding_gpu.py --model qwen2_1_5b --cap-gib 11.25 --cases baseline_zero3_offload --steps 4 \
  --no-prebuild --out $R/base_q15 > $R/base_q15.log 2>&1; echo "base rc=$?"; tail -3 $R/base_q15.log | cut -c1-600
cd /tmp && tar czf $OUT/session9_c.tgz s9c && ls -la $OUT
