#!/usr/bin/env bash
# Ready means ready, on a machine whose Triton cache starts cold: `moeserve serve` (Moonlight
# shape, dummy bf16), then concurrency 1 and 32 (1024 in / 128 out), the kernels first used after
# ready (counted and named) and the first request's TTFT. Needs the wheels carried as `.whl`.
#   run: bash scripts/gpu_session.sh ready $OUT
#   SERVE_FLAGS=--no-enable-prefix-caching bash scripts/gpu_session.sh ready $OUT   # the cache off
#   TILES=1 C1_PROMPTS=16 ...: the fused-MoE tile sweep first (scripts/gpu_session.sh tiles)
source "$(dirname "$0")/steps.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:/tmp/site
cp COMMIT "$work/commit.txt" 2>/dev/null || git log -1 --format="commit %H %s" > "$work/commit.txt" 2>/dev/null
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$work/gpu.txt" 2>&1
if [ "${TILES:-0}" = 1 ]; then
  step tiles 330 python3 scripts/sweeps/moe_tile_sweep.py --out "$work/moe_tiles.json"
  grep -A12 "^| tokens" "$work/tiles.log" >> "$work/summary.txt"
  cp "$work/moe_tiles.json" "$out/" 2>/dev/null
fi
python3 -m moeserve serve --model moonlight-16b-a3b --load-format dummy --dtype bfloat16 --max-model-len 2048 ${SERVE_FLAGS:-} \
  --host 127.0.0.1 --port 8016 > "$work/server.log" 2>&1 &
server=$!
step ready 150 python3 -m moeserve wait-ready --url http://127.0.0.1:8016 --timeout 140
for c in 1 32; do
  step "c$c" 60 python3 -m moeserve bench --url http://127.0.0.1:8016 --vocab 100000 --concurrency $c --seed $((1000 + c)) \
    --num-prompts $((c == 1 ? ${C1_PROMPTS:-8} : 4 * c)) --input-len 1024 --output-len 128 --result-dir "$work/c$c"
done
kill -TERM $server; wait $server
grep -h "ready in" "$work/server.log" >> "$work/summary.txt"
echo "kernels first used after ready: $(grep -c 'first used after ready' "$work/server.log")" >> "$work/summary.txt"
grep -h "first used after ready" "$work/server.log" | sed 's/.*ready (a gap in the warm-up): //' | cut -c1-100 | sort | uniq -c >> "$work/summary.txt"
for c in 1 32; do echo "c$c: $(grep -h '^| [0-9]' "$work/c$c.log" | head -1)" >> "$work/summary.txt"; done
python3 -c "import json,sys,statistics as st; t=json.load(open(sys.argv[1]))['ttfts_ms']; print('c1 TTFT ms: first', round(t[0],1), 'median', round(st.median(t),1), 'all', [round(x,1) for x in t])" \
  "$work/c1/concurrency_1.json" >> "$work/summary.txt" 2>&1
pack
