#!/usr/bin/env bash
# One device call for the serving-speed issue: the offline rates (prefill, steady decode at batch
# 1/128/256) and `moeserve serve` + `moeserve bench --url` at concurrency 1, 32, 128 (4x as many
# prompts as the concurrency, 1024 in / 128 out), Moonlight shape, dummy bf16; then the lone-prompt
# prefill profile. Needs the wheels of scripts/fetch_server_wheels.sh carried as `.whl`.
#   run: bash scripts/gpu_session.sh serving $OUT
source "$(dirname "$0")/steps.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:/tmp/site
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$work/gpu.txt" 2>&1
cp COMMIT "$work/commit.txt" 2>/dev/null || git log -1 --format="commit %H %s" > "$work/commit.txt" 2>/dev/null
MODEL=(--model moonlight-16b-a3b --load-format dummy --dtype bfloat16)
step offline 150 python3 -m moeserve bench --offline "${MODEL[@]}" --batch-sizes 1,128,256 --input-len 1024 \
  --output-len 128 --max-model-len 2048 --result-dir "$work/offline"
python3 -m moeserve serve "${MODEL[@]}" --max-model-len 2048 --host 127.0.0.1 --port 8011 > "$work/serve.log" 2>&1 &
server=$!
step ready 240 python3 -m moeserve wait-ready --url http://127.0.0.1:8011 --timeout 230
for c in 1 32 128; do
  step "serve_c$c" 100 python3 -m moeserve bench --url http://127.0.0.1:8011 --concurrency $c \
    --num-prompts $((4 * c)) --input-len 1024 --output-len 128 --vocab 100000 --result-dir "$work/serve_c$c"
done
kill -TERM $server; wait $server
step prefill_profile 60 python3 scripts/profile/prefill_profile.py --lengths 256,1024,4096
tail -n 12 "$work/offline.log" >> "$work/summary.txt"
for c in 1 32 128; do grep -h -A3 -i "throughput\|tpot\|ttft" "$work/serve_c$c.log" | head -12 >> "$work/summary.txt"; done
tail -n 25 "$work/prefill_profile.log" >> "$work/summary.txt" 2>/dev/null
pack
