#!/usr/bin/env bash
# One device call for issue 29 end to end: the humming backend's and the FP8 kernels' tests on the
# GPU, the FP8 routed experts at DeepSeek-V3's TP and EP shapes (the EP GEMV spread), then decode
# speed: Kimi K2.6 (8 layers, dummy INT4) at batch 1 and 64 on humming (auto) and on moeserve's
# Triton kernels, DeepSeek-V3 (5 layers, dummy FP8) at batch 1.
#   needs: humming-kernels, compressed-tensors + loguru (scripts/fetch_server_wheels.sh; .whl carried
#   and installed first); .hcache/cache.tgz (an earlier call's hcache.tgz, carried) saves humming's compiles
#   run: bash scripts/gpu_session.sh experts $OUT
source "$(dirname "$0")/steps.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$work/gpu.txt" 2>&1
cp COMMIT "$work/commit.txt" 2>/dev/null || git log -1 --format="commit %H %s" > "$work/commit.txt" 2>/dev/null
export HUMMING_CACHE_DIR=${HUMMING_CACHE_DIR:-$work/hcache}
mkdir -p "$HUMMING_CACHE_DIR"
[ -f .hcache/cache.tgz ] && tar xzf .hcache/cache.tgz -C "$HUMMING_CACHE_DIR"  # an earlier call's hcache.tgz
K26='{"num_hidden_layers": 8}'
step tests ${TESTS_S:-120} python3 -m pytest -q -p no:cacheprovider tests/test_humming_moe.py tests/test_moe_align.py \
  tests/test_kernels_fp8.py -x
step fp8_kernels ${FP8_S:-80} python3 scripts/sweeps/moe_kernel_bench.py --out "$work/fp8" --formats fp8 \
  --cases tp1,tp8,ep8-1local,ep8-2local --tokens 1,2,4,8 --time-limit $(( ${FP8_S:-80} - 10 ))
for backend in auto triton; do
  step e2e_k26_$backend ${E2E_S:-120} python3 scripts/gpu_check.py --model kimi-k2.6 --hf-overrides "$K26" \
    --out "$work/k26_$backend" --batch-sizes 1,64 --input-len 1024 --output-len 128 --skip-checks --profile '' \
    --moe-backend $backend
done
step e2e_v3 ${V3_S:-100} python3 scripts/gpu_check.py --model deepseek-v3 --hf-overrides '{"num_hidden_layers": 5}' \
  --out "$work/v3" --batch-sizes 1 --input-len 1024 --output-len 128 --skip-checks --profile ''
tail -4 "$work/tests.log" >> "$work/summary.txt"
sed -n '/^format case/,$p' "$work/fp8_kernels.log" >> "$work/summary.txt"
for f in e2e_k26_auto e2e_k26_triton e2e_v3; do
  echo "== $f" >> "$work/summary.txt"
  grep -h "routed INT4\|^batch\|Error" "$work/$f.log" | head -8 >> "$work/summary.txt"
done
tar czf "$out/hcache.tgz" -C "$HUMMING_CACHE_DIR" . 2>/dev/null
pack
