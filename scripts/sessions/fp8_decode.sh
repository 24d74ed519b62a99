#!/usr/bin/env bash
# One device call for FP8 decode: the decode-size FP8 kernels at DeepSeek-V3 shapes both ways
# (bf16-activation GEMV vs W8A8 with split K; MoE GEMV vs grouped W8A8), then every FP8 kernel test
# (the DeepSeek-V3-shape ones included).
#   run: bash scripts/gpu_session.sh fp8_decode $OUT
source "$(dirname "$0")/steps.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$work/gpu.txt" 2>&1
cp COMMIT "$work/commit.txt" 2>/dev/null || git log -1 --format='commit %H %s' > "$work/commit.txt" 2>/dev/null
step fp8_sweep 360 python3 scripts/sweeps/fp8_sweep.py --out "$work/fp8_sweep.json"
step fp8_kernels 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_fp8.py
sed -n '/^shape /,$p' "$work/fp8_sweep.log" >> "$work/summary.txt"
tail -n 6 "$work/fp8_kernels.log" >> "$work/summary.txt"
pack
