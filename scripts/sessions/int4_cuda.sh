#!/usr/bin/env bash
# One device call for issue 29's INT4 decode GEMV in CUDA C (kernels/int4_gemv_cuda.py, MOESERVE_INT4_GEMV=cuda).
# Its GPU tests (random shapes, every swept tile, a CUDA graph, K2.6's shapes, the engine against the
# Triton GEMV), the routed-expert bench at the GEMV's token counts with --cuda-gemv (each point
# checked against the default and, at 1 and 8 tokens, the reference; SWEEP=1: its tiles at 1 token), then
# K2.6 (8 layers, dummy INT4, Triton backend) decode at batch 1 and 8 with MOESERVE_INT4_GEMV=triton
# and =cuda on the same warm machine (E2E="": none; E2E="auto": the default).
#   env: TESTS_K (a -k filter), CASES (bench cases), TOKENS (bench token counts), SWEEP=1, E2E ("triton cuda"), E2E_BATCHES (1,8)
#   run: bash scripts/gpu_session.sh int4_cuda $OUT
source "$(dirname "$0")/steps.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$work/gpu.txt" 2>&1
cp COMMIT "$work/commit.txt" 2>/dev/null || git log -1 --format="commit %H %s" > "$work/commit.txt" 2>/dev/null
K26=${K26:-'{"num_hidden_layers": 8}'}  # 6 layers on an 80 GB card: 8 leave no KV cache
step tests ${TESTS_S:-120} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_int4_gemv_cuda.py ${TESTS_K:+-k "$TESTS_K"}
step bench ${BENCH_S:-170} python3 scripts/sweeps/moe_kernel_bench.py --out "$work/bench" --formats int4 \
  --cases ${CASES:-tp1,tp2,tp8,ep8-1local,ep8-2local,ep2-4local} --tokens ${TOKENS:-1,2,4,8,16} \
  --cuda-gemv ${SWEEP:+sweep --sweep-gemv-max-tokens 1} --time-limit $(( ${BENCH_S:-170} - 10 ))
for variant in ${E2E-triton cuda}; do
  step e2e_k26_$variant ${E2E_S:-120} env MOESERVE_INT4_GEMV=$variant python3 scripts/gpu_check.py --model kimi-k2.6 \
    --hf-overrides "$K26" --out "$work/k26_$variant" --batch-sizes ${E2E_BATCHES:-1,8} --input-len 1024 --output-len 128 --skip-checks \
    --profile '' --moe-backend triton
done
tail -4 "$work/tests.log" >> "$work/summary.txt"
grep -h "FAILED\|Error" "$work/tests.log" | head -10 >> "$work/summary.txt"
sed -n '/^format case/,$p' "$work/bench.log" >> "$work/summary.txt"
for f in "$work"/e2e_*.log; do
  [ -f "$f" ] || continue
  echo "== $(basename "$f")" >> "$work/summary.txt"
  grep -h "^batch\|│ *[0-9]\|Error" "$f" | head -8 >> "$work/summary.txt"
done
pack
