#!/usr/bin/env bash
# Prefill CUDA graphs on one H200 (Moonlight shape, dummy bf16): the lone-prompt prefill profile
# with graphs (256 / 1024 / 4096 tokens) and a 128-token extend over a 4096-token cached prefix,
# graphed and eager, each with its graphs-vs-eager logits check; then the offline benchmark at
# batch 1 / 128 / 256 (1024 in / 128 out) with the graphs-vs-eager and fast-vs-reference checks,
# bf16 and float32.
#   run: bash scripts/gpu_session.sh graphs $OUT
source "$(dirname "$0")/steps.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$work/gpu.txt" 2>&1
cp COMMIT "$work/commit.txt" 2>/dev/null || git log -1 --format="commit %H %s" > "$work/commit.txt" 2>/dev/null
step prefill_graphs 90 python3 scripts/profile/prefill_profile.py --lengths 256,1024,4096 --graphs --top 12
step prefix_graphs 60 python3 scripts/profile/prefill_profile.py --lengths 128 --prefix 4096 --graphs --top 12
step prefix_eager 60 python3 scripts/profile/prefill_profile.py --lengths 128 --prefix 4096 --top 12
step prefix_eager_absorbed 60 env MOESERVE_MLA_PREFIX=absorbed python3 scripts/profile/prefill_profile.py --lengths 128 --prefix 4096 --top 12
step moon 200 python3 scripts/gpu_check.py --out "$work/moon" --batch-sizes 1,128,256 --input-len 1024 \
  --output-len 128 --profile '' --check-prompt-lens 7,300,1000
step moon_fp32 150 python3 scripts/gpu_check.py --out "$work/moonfp32" --skip-bench --dtype float32 \
  --check-prompt-lens 7,300,1000
grep -h "^## prompt\|graphs vs eager\|no prefill" "$work"/prefill_graphs.log "$work"/prefix_*.log >> "$work/summary.txt" 2>/dev/null
grep -h "^batch\|CHECK\|exact\|mismatch" "$work"/moon.log "$work"/moon_fp32.log >> "$work/summary.txt" 2>/dev/null
pack
