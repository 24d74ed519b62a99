#!/usr/bin/env bash
# One short device call after a sampler change (issue 34): the sampler's GPU tests, its kernels one by
# one at batch 256 beside greedy (scripts/profile/sampler_profile.py), and Moonlight offline decode
# (dummy bf16, batch 1/64/256, 128 in / 64 out) greedy against top-k 50 + top-p 0.95 + T 0.8 and
# top-p 0.95 alone, both through the Triton sampler.
#   run: bash scripts/gpu_session.sh sampler_followup $OUT
source "$(dirname "$0")/steps.sh"
cp COMMIT "$work/commit.txt" 2>/dev/null || git log -1 --format="commit %H %s" > "$work/commit.txt" 2>/dev/null
step tests 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_logit_filter.py tests/engine/test_sampler_filter.py
step profile 40 python3 scripts/profile/sampler_profile.py --batch 256 --flat
for mode in greedy topkp topp; do
  case $mode in
    greedy) flags=(--temperature 0) ;;
    topkp) flags=(--temperature 0.8 --top-p 0.95 --top-k 50) ;;
    topp) flags=(--temperature 1.0 --top-p 0.95) ;;
  esac
  step "offline_$mode" 70 env MOESERVE_SAMPLER=triton python3 -m moeserve bench --offline --model moonlight-16b-a3b --load-format dummy \
    --dtype bfloat16 --batch-sizes 1,64,256 --input-len 128 --output-len 64 "${flags[@]}" --result-dir "$work/offline_$mode"
done
grep -h "FAILED\|Error\|passed\|failed" "$work/tests.log" | head -10 >> "$work/summary.txt"
grep -h "==\|_kernel" "$work/profile.log" >> "$work/summary.txt"
for mode in greedy topkp topp; do
  echo "offline_$mode:" >> "$work/summary.txt"
  grep -h "│ *[0-9]" "$work/offline_$mode.log" | head -3 >> "$work/summary.txt"
done
pack
