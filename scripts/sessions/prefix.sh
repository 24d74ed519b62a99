#!/usr/bin/env bash
# One short device call for prefix caching: a 4,096-token shared prefix with 128-token distinct
# suffixes and 128 output tokens, concurrency 1 and 32, against `moeserve serve` with the prefix
# cache on (default) and off. Moonlight shape, dummy bf16. Needs the wheels carried as `.whl`.
#   run: bash scripts/gpu_session.sh prefix $OUT
source "$(dirname "$0")/steps.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:/tmp/site
cp COMMIT "$work/commit.txt" 2>/dev/null || git log -1 --format="commit %H %s" > "$work/commit.txt" 2>/dev/null
MODEL=(--model moonlight-16b-a3b --load-format dummy --dtype bfloat16 --max-model-len 8192)
BENCH=(--input-len 128 --output-len 128 --shared-prefix-len 4096 --vocab 100000)
for mode in on off; do
  flag=--enable-prefix-caching; [ $mode = off ] && flag=--no-enable-prefix-caching
  python3 -m moeserve serve "${MODEL[@]}" $flag --host 127.0.0.1 --port 8012 > "$work/serve_$mode.log" 2>&1 &
  server=$!
  step "ready_$mode" 120 python3 -m moeserve wait-ready --url http://127.0.0.1:8012 --timeout 110
  step "c1_$mode" 40 python3 -m moeserve bench --url http://127.0.0.1:8012 --concurrency 1 --num-prompts 4 \
    "${BENCH[@]}" --result-dir "$work/c1_$mode"
  step "c32_$mode" 60 python3 -m moeserve bench --url http://127.0.0.1:8012 --concurrency 32 --num-prompts 64 \
    "${BENCH[@]}" --result-dir "$work/c32_$mode"
  kill -TERM $server; wait $server
done
for f in c1_on c1_off c32_on c32_off; do echo "$f: $(grep -h '^| [0-9]' "$work/$f.log" | head -1)" >> "$work/summary.txt"; done
pack
