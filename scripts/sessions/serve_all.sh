#!/usr/bin/env bash
# Serving on one H200 (Moonlight shape, dummy bf16), `moeserve serve` + `moeserve bench --url`,
# each server started fresh:
#   - prefix-free 1024 in / 128 out at concurrency 1 / 32 / 128 (4x the prompts), and a 4-turn
#     conversation workload (256 new tokens a turn, 128 out, concurrency 8), prefix cache on, then off;
#   - the 4,096-token shared prefix (128-token suffixes, 128 out) at concurrency 1 (twice: the
#     second run finds the prefix cached) and 32, cache on, then off;
#   - concurrency 128 again with a 2,048-token step budget (--max-num-batched-tokens 2048);
# then the float32 checks (fast vs reference, graphs vs eager). Needs the wheels carried as `.whl`.
#   run: bash scripts/gpu_session.sh serve_all $OUT
source "$(dirname "$0")/steps.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:/tmp/site
cp COMMIT "$work/commit.txt" 2>/dev/null || git log -1 --format="commit %H %s" > "$work/commit.txt" 2>/dev/null
URL=http://127.0.0.1:8014
serve() {  # name, serve flags...
  local name=$1; shift
  python3 -m moeserve serve --model moonlight-16b-a3b --load-format dummy --dtype bfloat16 "$@" \
    --host 127.0.0.1 --port 8014 > "$work/server_$name.log" 2>&1 &
  server=$!
  step "ready_$name" 120 python3 -m moeserve wait-ready --url $URL --timeout 110
}
stop() { kill -TERM $server; wait $server; }
bench() {  # name, seconds, bench flags...
  local name=$1 limit=$2; shift 2
  step "$name" "$limit" python3 -m moeserve bench --url $URL --vocab 100000 "$@" --result-dir "$work/$name"
}
FREE=(--input-len 1024 --output-len 128)
TURNS=(--input-len 256 --output-len 128 --multi-turn 4 --concurrency 8 --num-prompts 32)
SHARED=(--input-len 128 --output-len 128 --shared-prefix-len 4096)
for mode in on off; do
  flag=--enable-prefix-caching; [ $mode = off ] && flag=--no-enable-prefix-caching
  serve "free_$mode" --max-model-len 2048 $flag
  for c in 1 32 128; do bench "free_${mode}_c$c" 60 --concurrency $c --num-prompts $((4 * c)) "${FREE[@]}"; done
  bench "turns_$mode" 60 "${TURNS[@]}"
  stop
done
for mode in on off; do
  flag=--enable-prefix-caching; [ $mode = off ] && flag=--no-enable-prefix-caching
  serve "shared_$mode" --max-model-len 4608 $flag
  bench "shared_${mode}_c1_first" 40 --concurrency 1 --num-prompts 4 "${SHARED[@]}"
  bench "shared_${mode}_c1" 40 --concurrency 1 --num-prompts 8 "${SHARED[@]}"
  bench "shared_${mode}_c32" 60 --concurrency 32 --num-prompts 64 "${SHARED[@]}"
  stop
done
serve budget2048 --max-model-len 2048 --max-num-batched-tokens 2048
bench budget2048_c128 60 --concurrency 128 --num-prompts 512 "${FREE[@]}"
stop
grep -h "ready in\|captured" "$work"/server_free_on.log >> "$work/summary.txt" 2>/dev/null
for f in "$work"/free_*.log "$work"/turns_*.log "$work"/shared_*.log "$work"/budget*.log; do
  echo "$(basename "$f"): $(grep -h '^| [0-9]' "$f" | head -1)" >> "$work/summary.txt"
done
step moon_fp32 170 python3 scripts/gpu_check.py --out "$work/moonfp32" --skip-bench --dtype float32 --check-prompt-lens 7,300,1000
grep -h "CHECK\|exact\|mismatch" "$work"/moon_fp32.log >> "$work/summary.txt" 2>/dev/null
pack
