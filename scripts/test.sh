#!/usr/bin/env bash
# memopt's test command. Every selected test must run and pass: the script exits non-zero when one fails, errors,
# is not collected, or when pytest stops early (interrupt, crash, no test selected).
#   scripts/test.sh            the whole suite: the fast tier, then the slow tier (both must pass)
#   scripts/test.sh fast       only the fast tier  (an explicit split: the slow tier is then reported as not run)
#   scripts/test.sh slow       only the slow tier
# First scripts/prepare_test_env.sh (libaio headers, DeepSpeed's compiled CPU ops). Extra arguments after the
# tier go to pytest. GPU tests carry the `gpu` marker and skip cleanly without a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
export TRANSFORMERS_VERBOSITY=error OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MEMOPT_STRICT_SKIPS=${MEMOPT_STRICT_SKIPS:-1}
tier=${1:-all}
case "$tier" in all|fast|slow) shift $(( $# > 0 ? 1 : 0 ));; -*) tier=all;; *) echo "usage: scripts/test.sh [all|fast|slow] [pytest args]" >&2; exit 2;; esac
if [ "${MEMOPT_SKIP_PREPARE:-0}" != 1 ]; then
  scripts/prepare_test_env.sh || { echo "scripts/prepare_test_env.sh failed: the suite's system needs are not met" >&2; exit 2; }
fi
workers=$(python -c "import os; print(max(1, min(4, os.cpu_count() or 1)))")
run_tier() {  # name, marker expression
  echo "== $1 tier =="
  # the slowest tests are named in every log, so the suite's time can be watched where it runs (CI)
  # worksteal: a worker that runs out of tests takes queued ones from the other, so a long test near the end does
  # not leave one core idle while it runs
  python -m pytest -m "$2" -n "$workers" --dist worksteal -q -p no:cacheprovider --durations=25 "${@:3}"
  local rc=$?
  # pytest: 0 all passed, 1 failures, 2 interrupted, 3 internal error, 4 usage error, 5 no test collected
  if [ $rc -ne 0 ]; then
    echo "$1 tier FAILED (pytest exit $rc): not every selected test ran and passed" >&2
    exit $rc
  fi
}
[ "$tier" = slow ] || run_tier fast "not slow" "$@"
[ "$tier" = fast ] || run_tier slow "slow" "$@"
case "$tier" in
  all) echo "all tests passed (fast and slow tiers)";;
  fast) echo "fast tier passed; the slow tier was NOT run (scripts/test.sh slow runs it)";;
  slow) echo "slow tier passed; the fast tier was NOT run (scripts/test.sh fast runs it)";;
esac
