#!/usr/bin/env bash
# One device call that re-measures everything BENCHMARKS.md records for one H200, within the
# 10-minute limit of a call: the fast-path bench and profile, float32 exactness, the kernel tests
# at real shapes, and (with the wheels of scripts/fetch_server_wheels.sh carried as .whl) the
# serving sweep. The device returns at most 8 files, so everything is packed into one archive.
#   run: bash scripts/gpu_session.sh $OUT        (carry [".whl"] for the sweep)
source "$(dirname "$0")/steps.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$work/gpu.txt" 2>&1
git log -1 --format='commit %H %s' > "$work/commit.txt" 2>/dev/null || true
step bench_bf16 200 python3 scripts/gpu_check.py --out "$work/bf16" --batch-sizes 1,8,64,256 \
  --input-len 1024 --output-len 256 --profile 1,256
step exact_fp32 170 python3 scripts/gpu_check.py --out "$work/fp32" --skip-bench --dtype float32
if ls .whl/*.whl > /dev/null 2>&1; then
  step sweep 140 bash scripts/sweeps/gpu_sweep.sh "$work/sweep" tp1 1,32,128
fi
# Last, with what is left of the call: the kernel tests compile a kernel per shape (slow).
# The real shapes of every kernel (the tiny ones run in CI), newest kernels first.
step kernel_tests 150 python3 -m pytest -q -p no:cacheprovider tests/model/test_router_hidden.py \
  tests/kernels/test_gemv.py tests/kernels/test_sampling_kernel.py tests/kernels/test_attention_fusions.py tests/kernels/test_kernels_moe.py -k "real or shared" \
  tests/kernels/test_kernels_mla.py tests/kernels/test_kernels_misc.py
grep -h "^ *[0-9]* \+[0-9,]* \+[0-9.]* \+[0-9,.]* \|CHECK" "$work/bench_bf16.log" "$work/exact_fp32.log" \
  >> "$work/summary.txt" 2>/dev/null
tail -3 "$work/kernel_tests.log" >> "$work/summary.txt" 2>/dev/null
pack
