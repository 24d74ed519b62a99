#!/usr/bin/env bash
# One short device call: fast vs reference and graphs vs eager greedy tokens on the Moonlight shape
# in bf16 and float32 (scripts/gpu_check.py --skip-bench), the check the structural issue asks for.
#   run: bash scripts/gpu_session.sh checks $OUT
source "$(dirname "$0")/steps.sh"
cp COMMIT "$work/commit.txt" 2>/dev/null || git log -1 --format="commit %H %s" > "$work/commit.txt" 2>/dev/null
step moon_bf16 110 python3 scripts/gpu_check.py --out "$work/moon" --skip-bench --check-prompt-lens 7,300,1000
step moon_fp32 150 python3 scripts/gpu_check.py --out "$work/moonfp32" --skip-bench --dtype float32 \
  --check-prompt-lens 7,300,1000
grep -h "CHECK" "$work"/moon_bf16.log "$work"/moon_fp32.log >> "$work/summary.txt" 2>/dev/null
pack
