#!/usr/bin/env bash
# What the suite needs beyond pip: the libaio headers (DeepSpeed's NVMe offload) and DeepSpeed's compiled CPU ops
# (cpu_adam, async_io), JIT-built once (about 4 minutes on 2 cores) into $TORCH_EXTENSIONS_DIR or torch's default.
# Without them the offload tests could only skip, and under scripts/test.sh a skip is a test that did not run.
set -euo pipefail
if [ ! -e /usr/include/libaio.h ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing libaio-dev (DeepSpeed's async I/O op needs its headers)"
    apt-get update -qq >/dev/null && apt-get install -y -qq libaio-dev >/dev/null
  else
    echo "libaio.h is missing: install libaio-dev (Debian/Ubuntu: sudo apt-get install libaio-dev), then rerun" >&2
    exit 2
  fi
fi
echo "building DeepSpeed's cpu_adam and async_io ops (cached after the first time)"
DS_ACCELERATOR=cpu python - <<'PY'
from deepspeed.ops.op_builder.cpu import AsyncIOBuilder, CPUAdamBuilder

for builder in (CPUAdamBuilder(), AsyncIOBuilder()):
    builder.load(verbose=False)
PY
