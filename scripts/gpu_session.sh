#!/usr/bin/env bash
# One GPU session = one device call: a named suite of time-limited steps (scripts/sessions/SUITE.sh,
# each sourcing scripts/sessions/steps.sh), its logs packed into $OUT/results.tgz with a
# $OUT/summary.txt beside it (the device returns at most 8 files).
#   bash scripts/gpu_session.sh SUITE $OUT     run a suite (env knobs: see the suite's header)
#   bash scripts/gpu_session.sh $OUT           the `full` suite (everything BENCHMARKS.md records)
#   bash scripts/gpu_session.sh --list         the suites, one line each
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)

list() {
  for f in "$here"/sessions/*.sh; do
    name=$(basename "$f" .sh)
    [ "$name" = steps ] && continue
    printf '  %-12s %s\n' "$name" "$(sed -n 2p "$f" | sed 's/^# *//')"
  done
}

if [ $# -eq 0 ] || [ "$1" = --list ] || [ "$1" = -h ] || [ "$1" = --help ]; then
  sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'
  echo "suites:"
  list
  exit 0
fi
if [ $# -ge 2 ]; then suite=$1; shift; else suite=full; fi
if [ "$suite" = steps ] || [ ! -f "$here/sessions/$suite.sh" ]; then
  echo "unknown suite '$suite'; the suites:" >&2
  list >&2
  exit 2
fi
exec bash "$here/sessions/$suite.sh" "$@"
