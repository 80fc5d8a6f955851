#!/usr/bin/env bash
# Moves constraints.txt forward: resolves the newest versions that pyproject.toml's ranges allow in a fresh venv,
# runs the whole test suite against them, and writes them to constraints.txt only if it passes (otherwise the old
# file stays and the failing set is left in constraints.new.txt to look at).
#   scripts/update_constraints.sh            (about 15 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(mktemp -d)/venv
python3 -m venv "$venv"
. "$venv/bin/activate"
python -m pip install -q --upgrade pip
pip install -q torch==2.13.0            # the CPU wheel; a newer torch would come as a CUDA build
pip install -q -e ".[dev,bnb,peft,deepspeed]"
{ sed -n '1,2p' constraints.txt; pip freeze --exclude-editable | grep -v '^memopt' | sed 's/^torch==\([0-9.]*\)+cpu$/torch==\1/'; } \
  > constraints.new.txt
diff -u constraints.txt constraints.new.txt || true
if scripts/test.sh; then
  mv constraints.new.txt constraints.txt
  echo "constraints.txt updated: the suite passed with the newest versions"
else
  echo "the suite failed with the newest versions: constraints.txt unchanged, the new set is in constraints.new.txt" >&2
  exit 1
fi
