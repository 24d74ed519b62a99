#!/usr/bin/env bash
# The bf16 fused-MoE tile sweep at the token counts a server's steps have (Moonlight shape), then
# ready means ready on a cold Triton cache: `moeserve serve` (dummy bf16), concurrency 1 and 32
# (1024 in / 128 out) and the count of kernels first used after ready. Needs the wheels as `.whl`.
#   run: bash scripts/gpu_session_tiles.sh $OUT
source "$(dirname "$0")/gpu_steps.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:/tmp/site
cp COMMIT "$work/commit.txt" 2>/dev/null || git log -1 --format="commit %H %s" > "$work/commit.txt" 2>/dev/null
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$work/gpu.txt" 2>&1
step tiles 330 python3 scripts/moe_tile_sweep.py --out "$work/moe_tiles.json"
grep -A12 "^| tokens" "$work/tiles.log" >> "$work/summary.txt"
cp "$work/moe_tiles.json" "$out/" 2>/dev/null
python3 -m moeserve serve --model moonlight-16b-a3b --load-format dummy --dtype bfloat16 --max-model-len 2048 \
  --host 127.0.0.1 --port 8016 > "$work/server.log" 2>&1 &
server=$!
step ready 150 python3 -m moeserve wait-ready --url http://127.0.0.1:8016 --timeout 140
for c in 1 32; do
  step "c$c" 60 python3 -m moeserve bench --url http://127.0.0.1:8016 --vocab 100000 --concurrency $c --seed $((100 + c)) \
    --num-prompts $((c == 1 ? 16 : 4 * c)) --input-len 1024 --output-len 128 --result-dir "$work/c$c"
done
kill -TERM $server; wait $server
grep -h "ready in" "$work/server.log" >> "$work/summary.txt"
echo "kernels first used after ready: $(grep -c 'first used after ready' "$work/server.log")" >> "$work/summary.txt"
grep -h "first used after ready" "$work/server.log" | sed 's/.*ready (a gap in the warm-up): //' | cut -c1-100 | sort | uniq -c >> "$work/summary.txt"
for c in 1 32; do echo "c$c: $(grep -h '^| [0-9]' "$work/c$c.log" | head -1)" >> "$work/summary.txt"; done
python3 - "$work/c1/concurrency_1.json" >> "$work/summary.txt" 2>&1 <<'PY'
import json, sys, statistics
d = json.load(open(sys.argv[1]))
t = d["ttfts_ms"]
print(f"c1 TTFT ms: first {t[0]:.1f}, median {statistics.median(t):.1f}, all {[round(x, 1) for x in t]}")
PY
pack
