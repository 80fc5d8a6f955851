#!/usr/bin/env bash
# Session 8 GPU run (nvidia-h200-x2), carrying .whl: two-GPU FSDP2 (memopt plan vs hand-written baseline, alternating
# rounds), then the single-GPU ZeRO-2 offload plans with the allocator history (what is live at the peak).
# Usage on the GPU host: bash benchmarks/sharding/session8_gpu.sh   (results: $OUT/session8_call2.tgz)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1; export PYTHONPATH=$PWD:/tmp/site TRANSFORMERS_VERBOSITY=error; R=/tmp/r; mkdir -p $R
(python3 -c "import sys;sys.path.insert(0,'scripts');from pathlib import Path;from validate_sharding_gpu import prebuild_deepspeed_ops as p;print(p(Path('$R/prebuild.log')))" > $R/prebuild.out 2>&1 &)
P=benchmarks/sharding/plans
for k in 1 2; do
timeout 150 torchrun --standalone --nproc-per-node 2 scripts/wrap_sharded_gpu.py run --plan $P/llama32_3b_48GiB_x2.json --out $R/wrap_r$k --steps 10 > $R/wrap_r$k.log 2>&1; echo "wrap r$k rc=$?"
timeout 150 python3 scripts/validate_sharding_gpu.py --two-gpu --cases baseline_fsdp2_x2 --cap-gib 47.25 --steps 10 --no-prebuild --out $R/base_r$k > $R/base_r$k.log 2>&1; echo "base r$k rc=$?"
done
timeout 120 torchrun --standalone --nproc-per-node 2 scripts/wrap_sharded_gpu.py run --plan $P/llama32_3b_48GiB_x2_runnerup_fullac.json --out $R/fullac --steps 10 > $R/fullac.log 2>&1; echo "fullac rc=$?"
for i in $(seq 60); do grep -q prebuild_s $R/prebuild.out 2>/dev/null && break; sleep 5; done; cat $R/prebuild.out
W=benchmarks/wrap/plans/session7_offload
CUDA_VISIBLE_DEVICES=0 timeout 200 torchrun --standalone --nproc-per-node 1 scripts/wrap_sharded_gpu.py run --plan $W/qwen25_0_5b_12GiB.json --out $R/qwen_hist --steps 3 --history > $R/qwen_hist.log 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout 200 torchrun --standalone --nproc-per-node 1 scripts/wrap_sharded_gpu.py run --plan $W/llama32_1b_12GiB.json --out $R/llama_hist --steps 3 --history > $R/llama_hist.log 2>&1 &
wait; echo hist done
grep -h '^{"plan"' $R/*.log | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print(r['plan'][:60], r['rank'], round(r['measured_step_s'],4), r['measured_peak_allocated_bytes'], r['measured_peak_reserved_bytes'], r['num_alloc_retries'])"
grep -h "\[done\]" $R/base_r*.log
cd /tmp && tar czf $OUT/session8_call2.tgz r && ls -la $OUT
