#!/usr/bin/env bash
# Session 9, two H200s (nvidia-h200-x2, carrying .whl), if lent: DeepSpeed ZeRO-3 over two GPUs with today's
# train step (the model output dropped before DeepSpeed's backward): memopt's case and the hand-written ZeRO-3
# full-offload baseline, 48 GiB cap per GPU, Llama-3.2-3B, 8 x 2048.
# Usage on the GPU host: bash benchmarks/sharding/session9_gpu_x2.sh   (results: $OUT/session9_x2.tgz)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site TRANSFORMERS_VERBOSITY=error
R=/tmp/s9x2; mkdir -p $R
timeout 270 python3 scripts/validate_sharding_gpu.py --two-gpu --cases memopt_zero3_x2,baseline_zero3_offload_x2 \
  --steps 3 --deadline 150 --out $R/z3x2 > $R/z3x2.log 2>&1; echo "rc=$?"; grep -h "\[done\]" $R/z3x2.log | cut -c1-300
cd /tmp && tar czf $OUT/session9_x2.tgz s9x2 && ls -la $OUT
