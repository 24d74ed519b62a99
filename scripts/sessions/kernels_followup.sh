#!/usr/bin/env bash
# One short device call after a kernel change (issues 29 and 34): the INT4 GEMV's fp16-pair dot
# against the fp32 one at Kimi K2.6's one-token shapes (kernel tests, bench), and the Triton
# sampler's kernels one by one at batch 256 (scripts/profile/sampler_profile.py, Zipf-like and
# flat rows) beside greedy.
#   env: CASES, TOKENS (the bench's), BATCH (the profile's)
#   run: bash scripts/gpu_session.sh kernels_followup $OUT
source "$(dirname "$0")/steps.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$work/gpu.txt" 2>&1
cp COMMIT "$work/commit.txt" 2>/dev/null || git log -1 --format="commit %H %s" > "$work/commit.txt" 2>/dev/null
step tests ${TESTS_S:-90} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_int4.py -k "f16x2 or kimi_k26_decode"
step bench ${BENCH_S:-90} python3 scripts/sweeps/moe_kernel_bench.py --out "$work/bench" --formats int4 \
  --cases ${CASES:-tp1,tp8,ep8-1local} --tokens ${TOKENS:-1,2,4} --dot f16x2 --time-limit $(( ${BENCH_S:-90} - 10 ))
step sampler ${SAMPLER_S:-60} python3 scripts/profile/sampler_profile.py --batch ${BATCH:-256}
step sampler_flat ${SAMPLER_S:-60} python3 scripts/profile/sampler_profile.py --batch ${BATCH:-256} --flat
grep -h "FAILED\|Error\|passed\|failed" "$work/tests.log" | head -10 >> "$work/summary.txt"
sed -n '/^format case/,$p' "$work/bench.log" >> "$work/summary.txt"
cat "$work/sampler.log" "$work/sampler_flat.log" >> "$work/summary.txt"
pack
