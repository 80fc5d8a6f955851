#!/usr/bin/env bash
# Session 8, third GPU run (nvidia-h200, carrying .whl): two wrap rows re-timed alone (their first run shared the
# host's CPUs with a DeepSpeed build), then DeepSpeed ZeRO-3 with optimizer and parameters on the CPU (llama32_3b,
# 16 GiB) applied by memopt.wrap with the allocator history: what is live at the allocated peak.
# Usage on the GPU host: bash benchmarks/sharding/session8_gpu_b.sh   (results: $OUT/session8_call4.tgz)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site TRANSFORMERS_VERBOSITY=error
R=/tmp/r4; mkdir -p $R
timeout 120 python3 scripts/gpu_session.py --out $R/retime --parts wrap --deadline 100 \
   --wrap-plans benchmarks/wrap/plans/session8_retime > $R/retime.log 2>&1; echo "retime rc=$?"
python3 -c "import sys;sys.path.insert(0,'scripts');from pathlib import Path;from validate_sharding_gpu import prebuild_deepspeed_ops as p;print(p(Path('$R/prebuild.log')))" > $R/prebuild.out 2>&1
timeout 240 torchrun --standalone --nproc-per-node 1 scripts/wrap_sharded_gpu.py run --history \
   --plan benchmarks/sharding/plans/llama32_3b_16GiB_zero3_offload.json --out $R/z3 --steps 2 > $R/z3.log 2>&1; echo "z3 rc=$?"
python3 -c "
import json
for l in open('$R/retime/wrap.jsonl'):
    r=json.loads(l); print(r.get('label'), r.get('measured_step_s'), r.get('predicted_step_s'), r.get('step_times_s'))"
grep -h '^{"plan"' $R/z3.log | cut -c1-3000
cd /tmp && tar czf $OUT/session8_call4.tgz r4 && ls -la $OUT
