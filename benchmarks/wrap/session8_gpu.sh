#!/usr/bin/env bash
# Session 8, second GPU run (nvidia-h200-x2, carrying .whl), two GPUs used side by side:
#   GPU 0: memopt.wrap on the 14 single-GPU plans of the validation matrix (benchmarks/wrap/plans/session8)
#   GPU 1: the offload plans: llama32_1b at 12 GiB (memopt.wrap, ZeRO-2 + CPU optimizer), llama32_3b at 16 GiB
#          (scripts/wrap_sharded_gpu.py), and the hand-written DeepSpeed ZeRO-3 full-offload baseline at 16 GiB
# Usage on the GPU host: bash benchmarks/wrap/session8_gpu.sh   (results: $OUT/session8_call3.tgz)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site TRANSFORMERS_VERBOSITY=error
R=/tmp/r3; mkdir -p $R
(CUDA_VISIBLE_DEVICES=0 timeout 500 python3 scripts/gpu_session.py --out $R/wrap --parts wrap --deadline 450 \
   --wrap-plans benchmarks/wrap/plans/session8 > $R/wrap.log 2>&1; echo "wrap rc=$?") &
(
  export CUDA_VISIBLE_DEVICES=1 OMP_NUM_THREADS=16
  python3 -c "import sys;sys.path.insert(0,'scripts');from pathlib import Path;from validate_sharding_gpu import prebuild_deepspeed_ops as p;print(p(Path('$R/prebuild.log')))" > $R/prebuild.out 2>&1
  timeout 150 python3 scripts/gpu_session.py --out $R/offload --parts wrap --deadline 140 \
     --wrap-plans benchmarks/wrap/plans/session8_offload > $R/offload.log 2>&1; echo "offload rc=$?"
  timeout 170 torchrun --standalone --nproc-per-node 1 scripts/wrap_sharded_gpu.py run \
     --plan benchmarks/sharding/plans/llama32_3b_16GiB_offload.json --out $R/l3b16 --steps 4 > $R/l3b16.log 2>&1; echo "l3b16 rc=$?"
  timeout 170 python3 scripts/validate_sharding_gpu.py --cases baseline_zero3_offload --cap-gib 15.25 --steps 4 \
     --no-prebuild --out $R/base_z3 > $R/base_z3.log 2>&1; echo "base_z3 rc=$?"
) &
wait
grep -h '"plan"' $R/wrap/wrap.jsonl $R/offload/wrap.jsonl 2>/dev/null | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); G=2**30
    print(r.get('label'), r.get('ok'), r.get('fits_under_cap'), round(r.get('measured_peak_allocated_bytes',0)/G,3), round(r.get('predicted_peak_allocated_bytes',0)/G,3), round(r.get('measured_peak_reserved_bytes',0)/G,3), round(r.get('predicted_peak_reserved_bytes',0)/G,3), round(r.get('measured_total_bytes',0)/G,3), r.get('measured_step_s'), r.get('predicted_step_s'), r.get('error','')[:200])"
grep -h '^{"plan"' $R/l3b16.log | cut -c1-900; grep -h "\[done\]" $R/base_z3.log
cd /tmp && tar czf $OUT/session8_call3.tgz r3 && ls -la $OUT
