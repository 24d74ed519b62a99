# Sourced by the gpu_session*.sh scripts: a scratch dir, the environment, time-limited steps,
# and one archive at the end (the device returns at most 8 files).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out=${1:?output dir}; mkdir -p "$out"
work=$(mktemp -d)
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1  # wheels installed with --target stay on the path
step() {  # name, seconds, command...: run with a time limit, log to $work/name.log, one summary line
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$work/$name.log" 2>&1
  local rc=$?
  echo "$name: rc $rc in $((SECONDS - t0)) s" | tee -a "$work/summary.txt"
  # what is done so far, under $out at once: a call cut off by its limit still returns it
  cp "$work/summary.txt" "$out/summary.txt"
  tar czf "$out/results.tgz" -C "$work" . 2>/dev/null
}
pack() {  # copy the summary next to the archive of everything, and print it
  cp "$work/summary.txt" "$out/summary.txt"
  tar czf "$out/results.tgz" -C "$work" .
  cat "$out/summary.txt"
}
