#!/usr/bin/env bash
# Session 9, second GPU run (nvidia-h200, carrying .whl): the disk's sequential bandwidth where ZeRO-Infinity
# swapped (dd with O_DIRECT, 1 MiB like DeepSpeed's aio block and 64 MiB blocks), then the planner's llama32_3b
# 16 GiB plan (ZeRO-2 + optimizer offload, full checkpointing) applied by memopt.wrap under the hard cap.
# Usage on the GPU host: bash benchmarks/sharding/session9_gpu_b.sh   (results: $OUT/session9_b.tgz)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site TRANSFORMERS_VERBOSITY=error
R=/tmp/s9b; mkdir -p $R /tmp/nvme_offload
df -h /tmp > $R/disk.txt; (cat /proc/cpuinfo | grep -c processor; free -b) >> $R/disk.txt
for bs in 1M 64M; do
  n=$([ $bs = 1M ] && echo 4096 || echo 64)
  dd if=/dev/zero of=/tmp/nvme_offload/bw.$bs bs=$bs count=$n oflag=direct 2>> $R/dd_write_$bs.txt
  dd if=/tmp/nvme_offload/bw.$bs of=/dev/null bs=$bs iflag=direct 2>> $R/dd_read_$bs.txt
  rm -f /tmp/nvme_offload/bw.$bs
done
tail -n1 $R/dd_*.txt
python3 -c "import sys;sys.path.insert(0,'scripts');from pathlib import Path;from validate_sharding_gpu import prebuild_deepspeed_ops as p;print(p(Path('$R/prebuild.log')))" > $R/prebuild.out 2>&1
timeout 220 torchrun --standalone --nproc-per-node 1 scripts/wrap_sharded_gpu.py run \
  --plan benchmarks/sharding/plans/s9_llama32_3b_16GiB_offload.json --out $R/z2_3b --steps 3 > $R/z2_3b.log 2>&1
echo "z2_3b rc=$?"; grep -h '^{"plan"' $R/z2_3b.log | cut -c1-1500
cd /tmp && tar czf $OUT/session9_b.tgz s9b && ls -la $OUT
