#!/usr/bin/env bash
# How a wave of shared-prefix requests is taken in and run, on one H200 (Moonlight shape, dummy
# bf16): first the graphed mixed step that a wave's arrivals make (ROWS prompts of 128 tokens
# after one 4,096-token cached prefix, beside DECODES decodes over 4,200), profiled with its host
# functions; then `moeserve serve` (prefix cache on) under MOESERVE_STEP_TRACE with the 4,096-token
# shared prefix, 128-token suffixes and 128 out at concurrency 1 and 32, each trace summarized
# (the engine loop's intake per request, how long a wave takes to be admitted). Needs `.whl`.
#   run: bash scripts/gpu_session_wave.sh $OUT
#   ROWS=9 DECODES=12 (the default); PROFILE=0: no step profile; MODES='on off'
source "$(dirname "$0")/gpu_steps.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:/tmp/site
cp COMMIT "$work/commit.txt" 2>/dev/null || git log -1 --format="commit %H %s" > "$work/commit.txt" 2>/dev/null
if [ "${PROFILE:-1}" = 1 ]; then
  step mixed_profile 200 python3 scripts/prefill_profile.py --graphs --lengths 128 --prefix 4096 --rows "${ROWS:-9}" \
    --decodes "${DECODES:-12}" --decode-context 4200 --top 25 --host
  grep -h "^## \|graphs vs eager\|host enqueue" "$work/mixed_profile.log" >> "$work/summary.txt"
fi
URL=http://127.0.0.1:8017
SHARED=(--input-len 128 --output-len 128 --shared-prefix-len 4096)
for mode in ${MODES:-on}; do
  flag=--enable-prefix-caching; [ $mode = off ] && flag=--no-enable-prefix-caching
  MOESERVE_STEP_TRACE=$work/steps_$mode.jsonl python3 -m moeserve serve --model moonlight-16b-a3b --load-format dummy \
    --dtype bfloat16 --max-model-len 4608 $flag --host 127.0.0.1 --port 8017 > "$work/server_$mode.log" 2>&1 &
  server=$!
  step "ready_$mode" 150 python3 -m moeserve wait-ready --url $URL --timeout 140
  step "c1_$mode" 40 python3 -m moeserve bench --url $URL --vocab 100000 --concurrency 1 --num-prompts 8 --seed 2 "${SHARED[@]}" --result-dir "$work/c1_$mode"
  wc -l < "$work/steps_$mode.jsonl" > "$work/c32_from_$mode.txt"
  step "c32_$mode" 60 python3 -m moeserve bench --url $URL --vocab 100000 --concurrency 32 --num-prompts 64 --seed 3 "${SHARED[@]}" --result-dir "$work/c32_$mode"
  kill -TERM $server; wait $server
  grep -h "uvloop\|httptools\|ready in\|kernel first used" "$work/server_$mode.log" | head -5 >> "$work/summary.txt"
  echo "== c1, cache $mode: $(grep -h '^| [0-9]' "$work/c1_$mode.log" | head -1)" >> "$work/summary.txt"
  echo "== c32, cache $mode: $(grep -h '^| [0-9]' "$work/c32_$mode.log" | head -1)" >> "$work/summary.txt"
  tail -n +"$(( $(cat "$work/c32_from_$mode.txt") + 1 ))" "$work/steps_$mode.jsonl" > "$work/steps_c32_$mode.jsonl"
  python3 scripts/step_trace_summary.py "$work/steps_c32_$mode.jsonl" --show 0 >> "$work/summary.txt" 2>&1
done
pack
