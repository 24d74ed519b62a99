#!/usr/bin/env bash
# One device call for the INT4 issue and the architecture refactor's no-regression check:
# the INT4 kernels at Kimi K2.6 shapes, the K2.6 shape (8 layers, dummy INT4 experts) benched
# at batch 1/8/64/256 with prefill 8x1024 beside its bounds, fast vs reference tokens in float32
# (3 layers), and Moonlight batch 1 / 256 for the bf16 path. Everything packed into one archive.
#   run: bash scripts/gpu_session.sh int4 $OUT
source "$(dirname "$0")/steps.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$work/gpu.txt" 2>&1
cp COMMIT "$work/commit.txt" 2>/dev/null || git log -1 --format="commit %H %s" > "$work/commit.txt" 2>/dev/null
K26='{"num_hidden_layers": 8}'
step int4_kernels 90 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_int4.py -x
step bench_k26 230 python3 scripts/gpu_check.py --model kimi-k2.6 --hf-overrides "$K26" --out "$work/k26" \
  --batch-sizes 1,8,64,256 --input-len 1024 --output-len 128 --profile 1,64 --check-prompt-lens 7,300
step exact_k26_fp32 100 python3 scripts/gpu_check.py --model kimi-k2.6 --hf-overrides '{"num_hidden_layers": 3}' \
  --out "$work/k26fp32" --skip-bench --dtype float32 --check-prompt-lens 7,300,1000
step bench_moonlight 120 python3 scripts/gpu_check.py --out "$work/moon" --batch-sizes 1,256 \
  --input-len 1024 --output-len 256 --profile '' --skip-checks
grep -h "^ *[0-9]* \+[0-9,]* \+[0-9.]* \+[0-9,.]* \|CHECK\|^batch" "$work"/bench_k26.log "$work"/exact_k26_fp32.log \
  "$work"/bench_moonlight.log >> "$work/summary.txt" 2>/dev/null
tail -3 "$work/int4_kernels.log" >> "$work/summary.txt" 2>/dev/null
pack
