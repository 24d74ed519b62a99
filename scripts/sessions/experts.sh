#!/usr/bin/env bash
# One device call for issue 29 end to end (and 35's verify cost): the humming backend's tests on the
# GPU, the FP8 routed experts at DeepSeek-V3's TP and EP shapes (the EP GEMV spread), then decode
# speed: Kimi K2.6 (8 layers, dummy INT4) at batch 1 and 64 on each of E2E_BACKENDS (auto picks
# humming where it is installed), DeepSeek-V3 (5 layers, dummy FP8) at batch 1, and DeepSeek-V3's
# MTP verify step at k = 0..3 draft tokens, batch 1/8/32 (dummy weights: acceptance near zero, so
# the figure is the cost of a verify step against a plain one).
#   needs: humming-kernels, compressed-tensors + loguru + pydantic (scripts/fetch_server_wheels.sh;
#   .whl carried and installed first); .hcache/cache.tgz (an earlier call's hcache.tgz, carried)
#   saves humming's compiles
#   env: E2E_BACKENDS, K26 (the hf-overrides of Kimi K2.6: 6 layers on an 80 GB card)
#   run: E2E_BACKENDS="auto triton" bash scripts/gpu_session.sh experts $OUT
source "$(dirname "$0")/steps.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$work/gpu.txt" 2>&1
cp COMMIT "$work/commit.txt" 2>/dev/null || git log -1 --format="commit %H %s" > "$work/commit.txt" 2>/dev/null
export HUMMING_CACHE_DIR=${HUMMING_CACHE_DIR:-/tmp/hcache}
mkdir -p "$HUMMING_CACHE_DIR"
[ -f .hcache/cache.tgz ] && tar xzf .hcache/cache.tgz -C "$HUMMING_CACHE_DIR"  # an earlier call's hcache.tgz
K26=${K26:-'{"num_hidden_layers": 8}'}  # 8 layers leave no KV cache on an 80 GB card: K26='{"num_hidden_layers": 6}' there
V3='{"num_hidden_layers": 5}'
step tests ${TESTS_S:-90} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_humming_moe.py -x
step fp8_kernels ${FP8_S:-70} python3 scripts/sweeps/moe_kernel_bench.py --out "$work/fp8" --formats fp8 \
  --cases tp1,tp8,ep8-1local,ep8-2local --tokens 1,2,4 --time-limit $(( ${FP8_S:-70} - 10 ))
for backend in ${E2E_BACKENDS:-auto triton}; do
  step e2e_k26_$backend ${E2E_S:-150} python3 scripts/gpu_check.py --model kimi-k2.6 --hf-overrides "$K26" \
    --out "$work/k26_$backend" --batch-sizes 1,64 --input-len 1024 --output-len 128 --skip-checks --profile '' \
    --moe-backend $backend
done
step e2e_v3 ${V3_S:-70} python3 scripts/gpu_check.py --model deepseek-v3 --hf-overrides "$V3" \
  --out "$work/v3" --batch-sizes 1 --input-len 1024 --output-len 128 --skip-checks --profile ''
step mtp_v3 ${MTP_S:-150} python3 -m moeserve bench --offline --model deepseek-v3 --load-format dummy --hf-overrides "$V3" \
  --batch-sizes 1,8,32 --input-len 512 --output-len 64 --speculative-config '{"method": "mtp"}' \
  --num-speculative-tokens 0,1,2,3 --result-dir "$work/mtp"
tail -4 "$work/tests.log" >> "$work/summary.txt"
sed -n '/^format case/,$p' "$work/fp8_kernels.log" >> "$work/summary.txt"
for f in "$work"/e2e_*.log; do
  echo "== $(basename "$f")" >> "$work/summary.txt"
  grep -h "routed INT4\|^batch\|Error" "$f" | head -8 >> "$work/summary.txt"
  grep -q "Error" "$f" && grep -B30 -m1 "Error:" "$f" | grep "File\|Error" | tail -12 >> "$work/summary.txt"
done
tail -25 "$work/mtp_v3.log" >> "$work/summary.txt"
tar czf "$out/hcache.tgz" -C "$HUMMING_CACHE_DIR" . 2>/dev/null
pack
