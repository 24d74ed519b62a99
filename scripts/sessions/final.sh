#!/usr/bin/env bash
# The serving figures of one commit on one H200 (Moonlight shape, dummy bf16), on a machine whose
# Triton cache starts cold: `moeserve serve` (prefix cache on, the first server) + `moeserve bench
# --url`, 1024 in / 128 out at concurrency 1 / 32 / 128, with every kernel first used after ready
# logged; the offline batch 1 / 128 / 256 rates of the same call; the 4,096-token shared prefix
# (128-token suffixes, 128 out) at concurrency 1 and 32 with the cache on and off; concurrency
# 32 and 128 prefix-free with the cache off. Needs the wheels carried as `.whl`.
#   run: bash scripts/gpu_session.sh final $OUT
#   SHARED_MODES=on OFF_CONCURRENCY=32 bash scripts/gpu_session.sh final $OUT    # a shorter call
#   TURNS=1: also the multi-turn workload (4 turns of 256 new tokens, 128 out, c8) with the cache on and off
#   PROFILE=1 bash scripts/gpu_session.sh final $OUT   # first: lone-prompt and cached-suffix step
#                                                      # profiles and the float32 correctness checks
#   CHECKS=1: the float32 correctness checks first, without the profiles
#   OFFLINE=0: no offline rates; OFF_CONCURRENCY='': no prefix-free server with the cache off
#   FREE_CONCURRENCY='1 32': the prefix-free levels of the first server (default 1 32 128; '': none)
#   CLIENT=1: first the bench client's own ceiling against scripts/stub_server.py (20 ms to the
#     first token, 11 ms a token: the c32 shared-prefix workload's ideal is 2,896 tok/s), and any
#     extra/*.py client scripts carried beside the snapshot
#   SERVING=0: only the steps above (checks, profiles, tests), no server
#   TRACE=1: each server writes its step trace (MOESERVE_STEP_TRACE) to steps_NAME.jsonl
#   REQTRACE=1: each server writes its request trace (MOESERVE_REQUEST_TRACE) to req_NAME.*.jsonl;
#     the summary has where the shared-prefix c1 requests' time to first token goes
#   PYTEST=1: first the CUDA-only tests of the attention kernels, the merges and the piecewise graphs
# Every bench run draws its own prompts (--seed); the shared prefix is the same for every seed.
source "$(dirname "$0")/steps.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:/tmp/site
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$work/gpu.txt" 2>&1
cp COMMIT "$work/commit.txt" 2>/dev/null || git log -1 --format="commit %H %s" > "$work/commit.txt" 2>/dev/null
if [ "${CLIENT:-0}" = 1 ]; then
  python3 scripts/stub_server.py --port 8130 > "$work/stub_server.log" 2>&1 &
  stub=$!
  sleep 3
  for i in 1 2; do
    step "client_ceiling_$i" 40 python3 -m moeserve bench --url http://127.0.0.1:8130 --vocab 100000 --concurrency 32 \
      --num-prompts 64 --seed 3 --input-len 128 --output-len 128 --shared-prefix-len 4096 --result-dir "$work/client_$i"
    echo "client_ceiling_$i: $(grep -h '^| [0-9]' "$work/client_ceiling_$i.log" | head -1)" >> "$work/summary.txt"
  done
  for f in extra/*.py; do [ -f "$f" ] && timeout 40 python3 "$f" >> "$work/summary.txt" 2>&1; done
  kill $stub
fi
if [ "${PYTEST:-0}" = 1 ]; then
  step pytest_cuda ${PYTEST_LIMIT:-150} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_lse_merge.py tests/kernels/test_kernels_mla.py \
    tests/model/test_fast_path.py -k "real or lse or merge or cuda"
  tail -3 "$work/pytest_cuda.log" >> "$work/summary.txt"
fi
if [ "${PROFILE:-0}" = 1 ]; then
  step prefill_graphs 90 python3 scripts/profile/prefill_profile.py --lengths 256,1024,4096 --graphs --top 12
  step prefix_eager 60 python3 scripts/profile/prefill_profile.py --lengths 128 --prefix 4096 --top 12
fi
if [ "${PROFILE:-0}" = 1 ] || [ "${CHECKS:-0}" = 1 ]; then
  export GPU_CHECK_DUMP_S=$((${CHECK_LIMIT:-300} - 10))
  step moon_fp32 ${CHECK_LIMIT:-300} python3 scripts/gpu_check.py --out "$work/moonfp32" --skip-bench --dtype float32 \
    --check-prompt-lens 7,300,1000
  grep -h "^## prompt\|graphs vs eager\|no prefill" "$work"/prefill_graphs.log "$work"/prefix_eager.log >> "$work/summary.txt" 2>/dev/null
  grep -h "CHECK\|exact\|mismatch" "$work"/moon_fp32.log >> "$work/summary.txt" 2>/dev/null
fi
if [ "${SERVING:-1}" = 0 ]; then pack; exit 0; fi
URL=http://127.0.0.1:8015
serve() {  # name, serve flags...
  local name=$1; shift
  [ "${TRACE:-0}" = 1 ] && export MOESERVE_STEP_TRACE=$work/steps_$name.jsonl
  [ "${REQTRACE:-0}" = 1 ] && export MOESERVE_REQUEST_TRACE=$work/req_$name
  python3 -m moeserve serve --model moonlight-16b-a3b --load-format dummy --dtype bfloat16 "$@" \
    --host 127.0.0.1 --port 8015 > "$work/server_$name.log" 2>&1 &
  server=$!
  step "ready_$name" 150 python3 -m moeserve wait-ready --url $URL --timeout 140
}
stop() { kill -TERM $server; wait $server; }
bench() {  # name, seconds, bench flags...
  local name=$1 limit=$2; shift 2
  step "$name" "$limit" python3 -m moeserve bench --url $URL --vocab 100000 "$@" --result-dir "$work/$name"
}
FREE=(--input-len 1024 --output-len 128)
SHARED=(--input-len 128 --output-len 128 --shared-prefix-len 4096)
FREE_CONCURRENCY=${FREE_CONCURRENCY-1 32 128}
if [ -n "$FREE_CONCURRENCY" ]; then
  serve free_on --max-model-len 2048
  for c in $FREE_CONCURRENCY; do bench "free_on_c$c" 60 --concurrency $c --num-prompts $((c == 1 ? 16 : 4 * c)) --seed $((1000 + c)) "${FREE[@]}"; done
  stop
fi
[ "${OFFLINE:-1}" = 1 ] && step offline 150 python3 scripts/gpu_check.py --out "$work/offline" --batch-sizes 1,128,256 --input-len 1024 \
  --output-len 128 --profile '' --skip-checks
for mode in ${SHARED_MODES:-on off}; do
  flag=--enable-prefix-caching; [ $mode = off ] && flag=--no-enable-prefix-caching
  serve "shared_$mode" --max-model-len 4608 $flag
  bench "shared_${mode}_c1_first" 40 --concurrency 1 --num-prompts 4 --seed 1 "${SHARED[@]}"
  bench "shared_${mode}_c1" 40 --concurrency 1 --num-prompts 8 --seed 2 "${SHARED[@]}"
  bench "shared_${mode}_c32" 60 --concurrency 32 --num-prompts 64 --seed 3 "${SHARED[@]}"
  [ "${TURNS:-0}" = 1 ] && bench "turns_$mode" 60 --concurrency 8 --num-prompts 32 --multi-turn 4 --input-len 256 --output-len 128 --seed 4
  stop
done
OFF_CONCURRENCY=${OFF_CONCURRENCY-32 128}
if [ -n "$OFF_CONCURRENCY" ]; then
  serve free_off --max-model-len 2048 --no-enable-prefix-caching
  for c in $OFF_CONCURRENCY; do bench "free_off_c$c" 60 --concurrency $c --num-prompts $((4 * c)) --seed $((1000 + c)) "${FREE[@]}"; done
  stop
fi
grep -h "ready in\|captured" "$work"/server_free_on.log >> "$work/summary.txt" 2>/dev/null
echo "kernels first used after ready: $(grep -c 'first used after ready' "$work"/server_free_on.log) (first server), $(cat "$work"/server_*.log | grep -c 'first used after ready') (all)" >> "$work/summary.txt"
grep -h "^batch" "$work"/offline.log >> "$work/summary.txt" 2>/dev/null
for f in "$work"/free_*.log "$work"/shared_*.log "$work"/turns_*.log; do
  echo "$(basename "$f"): $(grep -h '^| [0-9]' "$f" | head -1)" >> "$work/summary.txt"
done
for f in "$work"/steps_shared_*.jsonl; do
  [ -f "$f" ] && echo "$(basename "$f"): $(python3 scripts/profile/step_trace_summary.py "$f" --show 0 | grep -h 'intake\|waves')" >> "$work/summary.txt"
done
for mode in on off; do  # the c1 run's 8 requests, after the 4 of c1_first
  [ -f "$work/req_shared_$mode.http.jsonl" ] && { echo "request trace, shared_${mode}_c1:"; python3 scripts/profile/request_trace_summary.py \
    "$work/req_shared_$mode" --skip 4 --count 8; } >> "$work/summary.txt" 2>&1
done
for f in "$work"/*_c1/concurrency_1.json "$work"/*_c1_first/concurrency_1.json; do
  [ -f "$f" ] && python3 -c "import json,sys,statistics as st; t=json.load(open(sys.argv[1]))['ttfts_ms']; print(sys.argv[2], 'TTFT ms: first', round(t[0],1), 'median', round(st.median(t),1), 'all', [round(x,1) for x in t])" "$f" "$(basename "$(dirname "$f")")" >> "$work/summary.txt"
done
pack
