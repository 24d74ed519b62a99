#!/usr/bin/env bash
# One device call after a structural change: FP8 DeepSeek-V3 batch 1 (5 layers), Moonlight batch
# 1/256 with fast-vs-reference and graphs-vs-eager checks (bf16 and float32), `moeserve serve` +
# `moeserve bench --url` at concurrency 1/32/128 with the prefix cache on and 32/128 with it off
# (1024 in / 128 out, no shared prefix), then the lone-prompt prefill profile. Needs the wheels of
# scripts/fetch_server_wheels.sh carried as `.whl`.
#   run: bash scripts/gpu_session.sh regression $OUT
source "$(dirname "$0")/steps.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:/tmp/site
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$work/gpu.txt" 2>&1
cp COMMIT "$work/commit.txt" 2>/dev/null || git log -1 --format="commit %H %s" > "$work/commit.txt" 2>/dev/null
step v3_b1 100 python3 scripts/gpu_check.py --model deepseek-v3 --hf-overrides '{"num_hidden_layers": 5}' \
  --out "$work/v3" --batch-sizes 1 --input-len 1024 --output-len 128 --profile 1 --skip-checks
step moon 150 python3 scripts/gpu_check.py --out "$work/moon" --batch-sizes 1,256 --input-len 1024 \
  --output-len 256 --profile '' --check-prompt-lens 7,300,1000
step moon_fp32 150 python3 scripts/gpu_check.py --out "$work/moonfp32" --skip-bench --dtype float32 \
  --check-prompt-lens 7,300,1000
MODEL=(--model moonlight-16b-a3b --load-format dummy --dtype bfloat16 --max-model-len 2048)
BENCH=(--input-len 1024 --output-len 128 --vocab 100000)
for mode in on off; do
  flag=--enable-prefix-caching; [ $mode = off ] && flag=--no-enable-prefix-caching
  python3 -m moeserve serve "${MODEL[@]}" $flag --host 127.0.0.1 --port 8013 > "$work/serve_$mode.log" 2>&1 &
  server=$!
  step "ready_$mode" 120 python3 -m moeserve wait-ready --url http://127.0.0.1:8013 --timeout 110
  for c in $([ $mode = on ] && echo 1 32 128 || echo 32 128); do
    step "serve_${mode}_c$c" 60 python3 -m moeserve bench --url http://127.0.0.1:8013 --concurrency $c \
      --num-prompts $((4 * c)) "${BENCH[@]}" --result-dir "$work/serve_${mode}_c$c"
  done
  kill -TERM $server; wait $server
done
step prefill_profile 50 python3 scripts/profile/prefill_profile.py --lengths 256,1024,4096
grep -h "^batch\|CHECK\|ms/step wall" "$work"/v3_b1.log "$work"/moon.log "$work"/moon_fp32.log >> "$work/summary.txt" 2>/dev/null
for f in "$work"/serve_*_c*.log; do echo "$(basename "$f"): $(grep -h '^| [0-9]' "$f" | head -1)" >> "$work/summary.txt"; done
grep -h "^## prompt" "$work/prefill_profile.log" >> "$work/summary.txt" 2>/dev/null
pack
