#!/usr/bin/env bash
# The Moonlight regression figures of this tree against a base tree on the same warm machine (issue 31:
# "the GPU numbers are unchanged"): offline decode at batch 1 / 256 (1024 in / 256 out), `moeserve
# serve` + `moeserve bench --url` at concurrency 1 / 128 (1024 in / 128 out, prefix cache on), base
# then this tree; then this tree's fast-vs-reference checks in bf16 and float32, and the demo model's
# bf16 fast path against its reference path on the held-out tasks (issue 32).
# The base tree is made beforehand: git archive BASE src scripts | tar -x -C base (carried as `base`).
#   run: bash scripts/gpu_session.sh ab $OUT
source "$(dirname "$0")/steps.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$work/gpu.txt" 2>&1
cp COMMIT "$work/commit.txt" 2>/dev/null || git log -1 --format="commit %H %s" > "$work/commit.txt" 2>/dev/null
figures() {  # tag, tree: the offline and served figures of the tree's code
  local tag=$1 tree=$2
  export PYTHONPATH=$tree/src:/tmp/site
  step "${tag}_moon" 120 python3 "$tree/scripts/gpu_check.py" --out "$work/${tag}_moon" --batch-sizes 1,256 --input-len 1024 \
    --output-len 256 --profile '' --skip-checks
  python3 -m moeserve serve --model moonlight-16b-a3b --load-format dummy --dtype bfloat16 --max-model-len 2048 \
    --host 127.0.0.1 --port 8013 > "$work/${tag}_serve.log" 2>&1 &
  local server=$!
  step "${tag}_ready" 120 python3 -m moeserve wait-ready --url http://127.0.0.1:8013 --timeout 110
  for c in 1 128; do
    step "${tag}_c$c" 60 python3 -m moeserve bench --url http://127.0.0.1:8013 --concurrency $c --num-prompts $((4 * c)) \
      --input-len 1024 --output-len 128 --vocab 100000 --result-dir "$work/${tag}_c$c"
  done
  kill -TERM $server; wait $server
}
figures base "$PWD/base"
figures new "$PWD"
export PYTHONPATH=$PWD/src:/tmp/site
step checks_bf16 ${CHECK_S:-100} python3 scripts/gpu_check.py --out "$work/checks_bf16" --skip-bench --check-prompt-lens 7,300,1000
step checks_fp32 ${FP32_S:-240} python3 scripts/gpu_check.py --out "$work/checks_fp32" --skip-bench --dtype float32 --check-prompt-lens 7,300,1000
step demo_fast ${DEMO_S:-120} python3 -m pytest -q -s -p no:cacheprovider tests/demo/test_demo_tasks.py -k fast_path
for tag in base new; do
  grep -h "^batch" "$work/${tag}_moon.log" | sed "s/^/$tag /" >> "$work/summary.txt"
  for c in 1 128; do echo "$tag c$c: $(grep -h '^| [0-9]' "$work/${tag}_c$c.log" | head -1)" >> "$work/summary.txt"; done
done
grep -h "CHECK\|mismatch\|agree" "$work/checks_bf16.log" "$work/checks_fp32.log" | head -20 >> "$work/summary.txt"
grep -h "same\|passed\|failed" "$work/demo_fast.log" | tail -3 >> "$work/summary.txt"
pack
