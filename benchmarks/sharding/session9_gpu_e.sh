#!/usr/bin/env bash
# Session 9, fifth GPU run (nvidia-h200, carrying .whl): after the engine-overhead refit the planner moves Qwen2-1.5B
# at 12 GiB from ZeRO-3 (2 x 4) to ZeRO-2 + optimizer offload (ac=full[26], 1 x 8): that plan applied by memopt.wrap
# under the hard cap, out of the fit's sample (8 micro-batches; no ZeRO-2 row of this model).
# Usage on the GPU host: bash benchmarks/sharding/session9_gpu_e.sh   (results: $OUT/session9_e.tgz)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site TRANSFORMERS_VERBOSITY=error
R=/tmp/s9e; mkdir -p $R
python3 -c "import sys;sys.path.insert(0,'scripts');from pathlib import Path;from validate_sharding_gpu import prebuild_deepspeed_ops as p;print(p(Path('$R/prebuild.log')))" > $R/prebuild.out 2>&1
timeout 170 torchrun --standalone --nproc-per-node 1 scripts/wrap_sharded_gpu.py run \
  --plan benchmarks/sharding/plans/s9_qwen2_1_5b_12GiB_zero2.json --out $R/q15_z2 --steps 4 > $R/q15_z2.log 2>&1
echo "q15_z2 rc=$?"; grep -h '^{"plan"' $R/q15_z2.log | cut -c1-900
cd /tmp && tar czf $OUT/session9_e.tgz s9e && ls -la $OUT
