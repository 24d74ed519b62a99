#!/usr/bin/env bash
# One device call for issue 29's one-token INT4 shapes: the INT4 GEMV's spread kernels (kernels/int4_spread.py,
# MOESERVE_INT4_GEMV=spread; not the default until this shows they win). Their tests on the GPU (K2.6
# shapes against the reference, the start-up check), then Kimi K2.6's routed experts at TP1, TP8 and an
# EP8 rank with 1 and 2 local experts, at 1, 2 and 4 tokens: the measured GEMV beside the spread one
# (and humming with HUMMING=1), then the spread kernels' tile sweep at the same points.
#   knobs: CASES, TOKENS, HUMMING=1 (needs humming-kernels: scripts/fetch_server_wheels.sh, .whl carried
#   and installed first), TESTS_S / BENCH_S / SWEEP_S (seconds a step)
#   run: bash scripts/gpu_session.sh int4_spread $OUT
source "$(dirname "$0")/steps.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$work/gpu.txt" 2>&1
cp COMMIT "$work/commit.txt" 2>/dev/null || git log -1 --format="commit %H %s" > "$work/commit.txt" 2>/dev/null
CASES=${CASES:-tp1,tp8,ep8-1local,ep8-2local}
TOKENS=${TOKENS:-1,2,4}
step tests ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_int4.py -x \
  -k "spread_kimi or selfcheck or kimi_k26_decode"
step bench ${BENCH_S:-150} python3 scripts/sweeps/moe_kernel_bench.py --out "$work/bench" --formats int4 \
  --cases "$CASES" --tokens "$TOKENS" ${HUMMING:+--humming} --time-limit $(( ${BENCH_S:-150} - 10 ))
step sweep ${SWEEP_S:-250} python3 scripts/sweeps/moe_kernel_bench.py --out "$work/sweep" --formats int4 \
  --cases "$CASES" --tokens "$TOKENS" --sweep spread --time-limit $(( ${SWEEP_S:-250} - 10 ))
tail -4 "$work/tests.log" >> "$work/summary.txt"
for s in bench sweep; do
  echo "== $s" >> "$work/summary.txt"
  sed -n '/^format case/,$p' "$work/$s.log" >> "$work/summary.txt"
done
pack
