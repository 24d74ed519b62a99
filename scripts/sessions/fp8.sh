#!/usr/bin/env bash
# One device call for the FP8 issue: the FP8 kernels at DeepSeek-V3 shapes, the DeepSeek-V3 shape
# (5 layers: 3 dense + 2 MoE, dummy FP8 block weights) benched at batch 1/8/64/256 with prefill
# 8x1024 beside its bounds, and fast vs reference greedy tokens (bf16 and float32, 4 layers).
#   run: bash scripts/gpu_session.sh fp8 $OUT
source "$(dirname "$0")/steps.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$work/gpu.txt" 2>&1
cp COMMIT "$work/commit.txt" 2>/dev/null || git log -1 --format="commit %H %s" > "$work/commit.txt" 2>/dev/null
step fp8_kernels 170 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_fp8.py
step bench_v3 230 python3 scripts/gpu_check.py --model deepseek-v3 --hf-overrides '{"num_hidden_layers": 5}' \
  --out "$work/v3" --batch-sizes 1,8,64,256 --input-len 1024 --output-len 128 --profile 1 --check-prompt-lens 7,300
step exact_v3_fp32 120 python3 scripts/gpu_check.py --model deepseek-v3 --hf-overrides '{"num_hidden_layers": 4}' \
  --out "$work/v3fp32" --skip-bench --dtype float32 --check-prompt-lens 7,300
grep -h "^ *[0-9]* \+[0-9,]* \+[0-9.]* \+[0-9,.]* \|CHECK\|^batch" "$work"/bench_v3.log "$work"/exact_v3_fp32.log \
  >> "$work/summary.txt" 2>/dev/null
tail -n 4 "$work/fp8_kernels.log" >> "$work/summary.txt"
pack
