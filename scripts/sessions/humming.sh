#!/usr/bin/env bash
# One device call for issue 29's humming backend (`--moe-backend`, kernels/humming_moe.py): its tests
# on the GPU, the INT4 routed experts at every layout's K2.6 shape (ours beside the humming backend,
# same weights, routings and CUDA-graph harness), then the K2.6 shape (8 layers, dummy INT4) decoding
# at batch 1 and 64 on the backend `auto` picks. humming's JIT cache is packed apart (hcache.tgz):
# carried back in as .hcache/cache.tgz, it spares the next call the nvcc compiles.
#   needs: humming-kernels (scripts/fetch_server_wheels.sh, .whl carried and installed first)
#   run: bash scripts/gpu_session.sh humming $OUT
source "$(dirname "$0")/steps.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$work/gpu.txt" 2>&1
cp COMMIT "$work/commit.txt" 2>/dev/null || git log -1 --format="commit %H %s" > "$work/commit.txt" 2>/dev/null
export HUMMING_CACHE_DIR=${HUMMING_CACHE_DIR:-$work/hcache}
mkdir -p "$HUMMING_CACHE_DIR"
[ -f .hcache/cache.tgz ] && tar xzf .hcache/cache.tgz -C "$HUMMING_CACHE_DIR"  # an earlier call's hcache.tgz
step tests ${TESTS_S:-120} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_humming_moe.py tests/kernels/test_moe_align.py -x
step int4_kernels ${KERNELS_S:-270} python3 scripts/sweeps/moe_kernel_bench.py --out "$work/kernels" --formats int4 --humming \
  --cases ${CASES:-tp1,tp2,tp4,tp8,ep8-1local,ep8-2local,ep2-4local} --tokens ${TOKENS:-1,2,4,8,16,32,64,128,256} \
  --time-limit $(( ${KERNELS_S:-270} - 15 ))
step e2e_k26 ${E2E_S:-150} python3 scripts/gpu_check.py --model kimi-k2.6 --hf-overrides '{"num_hidden_layers": 8}' \
  --out "$work/k26" --batch-sizes 1,64 --input-len 1024 --output-len 128 --skip-checks --profile ''
tail -4 "$work/tests.log" >> "$work/summary.txt"
sed -n '/^format case/,$p' "$work/int4_kernels.log" >> "$work/summary.txt"
grep -h "routed INT4\|^ *[0-9]* \+[0-9,]* \+[0-9.]* \+[0-9,.]* \|^batch\|Error\|error" "$work/e2e_k26.log" | head -20 >> "$work/summary.txt"
tar czf "$out/hcache.tgz" -C "$HUMMING_CACHE_DIR" . 2>/dev/null
pack
