#!/usr/bin/env bash
# How the steps of the shared-prefix workload are composed and how long each takes: `moeserve
# serve` (Moonlight shape, dummy bf16, the prefix cache on) with MOESERVE_STEP_TRACE, the
# 4,096-token shared prefix with 128-token suffixes and 128 out at concurrency 1 then 32 (and
# the cache off at 32), each trace summarized by scripts/profile/step_trace_summary.py. Needs `.whl`.
#   run: bash scripts/gpu_session.sh trace $OUT
#   PROFILE=1: first the absorbed prefix kernel's tile / split sweep and the merges
#   (scripts/sweeps/absorbed_sweep.py), and the graphed 128-token step over 4,096 cached, profiled
#   MIXED=1: first the graphed mixed step a wave's arrivals make (ROWS prompts of 128 tokens after
#   one 4,096-token cached prefix, beside DECODES decodes over 4,200; 9 and 12 by default),
#   profiled with its host functions
source "$(dirname "$0")/steps.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:/tmp/site
cp COMMIT "$work/commit.txt" 2>/dev/null || git log -1 --format="commit %H %s" > "$work/commit.txt" 2>/dev/null
if [ "${PROFILE:-0}" = 1 ]; then
  step absorbed_sweep 150 python3 scripts/sweeps/absorbed_sweep.py
  step prefix_graphs 150 python3 scripts/profile/prefill_profile.py --lengths 128 --prefix 4096 --graphs --top 16
  grep -v "^ *{" "$work/absorbed_sweep.log" >> "$work/summary.txt"
  grep -h "^## prompt\|graphs vs eager" "$work/prefix_graphs.log" >> "$work/summary.txt"
fi
if [ "${MIXED:-0}" = 1 ]; then
  step mixed_profile 200 python3 scripts/profile/prefill_profile.py --graphs --lengths 128 --prefix 4096 --rows "${ROWS:-9}" \
    --decodes "${DECODES:-12}" --decode-context 4200 --top 25 --host
  grep -h "^## \|host enqueue" "$work/mixed_profile.log" >> "$work/summary.txt"
fi
URL=http://127.0.0.1:8017
SHARED=(--input-len 128 --output-len 128 --shared-prefix-len 4096)
for mode in ${MODES:-on off}; do
  flag=--enable-prefix-caching; [ $mode = off ] && flag=--no-enable-prefix-caching
  MOESERVE_STEP_TRACE=$work/steps_$mode.jsonl python3 -m moeserve serve --model moonlight-16b-a3b --load-format dummy \
    --dtype bfloat16 --max-model-len 4608 $flag --host 127.0.0.1 --port 8017 > "$work/server_$mode.log" 2>&1 &
  server=$!
  step "ready_$mode" 150 python3 -m moeserve wait-ready --url $URL --timeout 140
  step "c1_$mode" 40 python3 -m moeserve bench --url $URL --vocab 100000 --concurrency 1 --num-prompts 4 --seed 1 "${SHARED[@]}" --result-dir "$work/c1_$mode"
  wc -l < "$work/steps_$mode.jsonl" > "$work/c32_from_$mode.txt"
  step "c32_$mode" 60 python3 -m moeserve bench --url $URL --vocab 100000 --concurrency 32 --num-prompts 64 --seed 3 "${SHARED[@]}" --result-dir "$work/c32_$mode"
  kill -TERM $server; wait $server
  head -n "$(cat "$work/c32_from_$mode.txt")" "$work/steps_$mode.jsonl" > "$work/steps_c1_$mode.jsonl"
  echo "== c1, cache $mode: $(grep -h '^| [0-9]' "$work/c1_$mode.log" | head -1)" >> "$work/summary.txt"
  python3 scripts/profile/step_trace_summary.py "$work/steps_c1_$mode.jsonl" --show 12 >> "$work/summary.txt" 2>&1
  tail -n +"$(( $(cat "$work/c32_from_$mode.txt") + 1 ))" "$work/steps_$mode.jsonl" > "$work/steps_c32_$mode.jsonl"
  echo "== c32, cache $mode: $(grep -h '^| [0-9]' "$work/c32_$mode.log" | head -1)" >> "$work/summary.txt"
  python3 scripts/profile/step_trace_summary.py "$work/steps_c32_$mode.jsonl" --show 70 >> "$work/summary.txt" 2>&1
done
pack
