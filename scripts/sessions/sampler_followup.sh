#!/usr/bin/env bash
# One short device call after a sampler change (issue 34): the sampler's GPU tests, Moonlight offline decode
# (dummy bf16, batch 1/64/256, 128 in / 64 out) greedy against top-k 50 + top-p 0.95 + T 0.8 and
# top-p 0.95 alone, both through the Triton sampler; then, in the same call (the issue's rule), one
# `moeserve serve` (prefix cache off: a second pass over the same prompts would find them cached)
# and `moeserve bench --url` greedy then top-k 50 + top-p 0.95 + T 0.8 on the same prompts; last, the
# sampler's kernels one by one at batch 256 and 1 beside greedy (scripts/profile/sampler_profile.py).
#   env: MODES="greedy topkp topp" (the offline runs), CONCURRENCY="1 32 128" (served; empty: none),
#        PROMPTS_PER_C=4 (served prompts per unit of concurrency)
#   run: bash scripts/gpu_session.sh sampler_followup $OUT
source "$(dirname "$0")/steps.sh"
cp COMMIT "$work/commit.txt" 2>/dev/null || git log -1 --format="commit %H %s" > "$work/commit.txt" 2>/dev/null
step tests 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_logit_filter.py tests/engine/test_sampler_filter.py
MODES=${MODES:-greedy topkp topp}
CONCURRENCY=${CONCURRENCY-1 32 128}
for mode in $MODES; do
  case $mode in
    greedy) flags=(--temperature 0) ;;
    topkp) flags=(--temperature 0.8 --top-p 0.95 --top-k 50) ;;
    topp) flags=(--temperature 1.0 --top-p 0.95) ;;
  esac
  step "offline_$mode" 70 env MOESERVE_SAMPLER=triton python3 -m moeserve bench --offline --model moonlight-16b-a3b --load-format dummy \
    --dtype bfloat16 --batch-sizes 1,64,256 --input-len 128 --output-len 64 "${flags[@]}" --result-dir "$work/offline_$mode"
done
if [ -n "$CONCURRENCY" ]; then
  python3 -m moeserve serve --model moonlight-16b-a3b --load-format dummy --dtype bfloat16 --max-model-len 2048 \
    --no-enable-prefix-caching --host 127.0.0.1 --port 8013 > "$work/serve.log" 2>&1 &
  server=$!
  step ready 240 python3 -m moeserve wait-ready --url http://127.0.0.1:8013 --timeout 230
  for c in $CONCURRENCY; do
    for mode in greedy topkp; do
      flags=(--temperature 0)
      [ $mode = topkp ] && flags=(--temperature 0.8 --extra-body '{"top_p": 0.95, "top_k": 50}')
      step "served_${mode}_c$c" 120 python3 -m moeserve bench --url http://127.0.0.1:8013 --concurrency "$c" --num-prompts $((${PROMPTS_PER_C:-4} * c)) \
        --input-len 1024 --output-len 128 --vocab 100000 "${flags[@]}" --result-dir "$work/served_${mode}_c$c"
    done
  done
  kill -TERM $server; wait $server
fi
step profile 40 python3 scripts/profile/sampler_profile.py --batch 256 --flat
step profile_b1 30 python3 scripts/profile/sampler_profile.py --batch 1 --flat
grep -h "FAILED\|Error\|passed\|failed" "$work/tests.log" | head -10 >> "$work/summary.txt"
grep -h "==\|_kernel" "$work/profile.log" "$work/profile_b1.log" >> "$work/summary.txt"
for mode in $MODES; do
  echo "offline_$mode:" >> "$work/summary.txt"
  grep -h "│ *[0-9]" "$work/offline_$mode.log" | head -3 >> "$work/summary.txt"
done
for c in $CONCURRENCY; do
  for mode in greedy topkp; do
    echo "served_${mode}_c$c:" >> "$work/summary.txt"
    grep -h "│ *[0-9]\|^| *[0-9]" "$work/served_${mode}_c$c.log" | head -2 >> "$work/summary.txt"
  done
done
pack
