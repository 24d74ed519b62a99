#!/usr/bin/env bash
# One device call for the cost of structured outputs (issue 34): Moonlight shape, dummy bf16, with
# a made-up 163,840-token byte-level BPE tokenizer (scripts/synthetic_tokenizer.py: xgrammar's
# masks at the model's real vocabulary size), one `moeserve serve`, `moeserve bench --url` at
# concurrency 1 and 32, plain then every request under a json_schema (--extra-body), same server,
# same prompts. A dummy model's reply ends when the grammar's JSON does: compare TPOT and tok/s.
# Needs the wheels of scripts/fetch_server_wheels.sh (xgrammar among them) carried as `.whl`.
#   env: OUTPUT_LEN=128
#   run: bash scripts/gpu_session.sh structured $OUT
source "$(dirname "$0")/steps.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PYTHONPATH:/tmp/site
cp COMMIT "$work/commit.txt" 2>/dev/null || git log -1 --format="commit %H %s" > "$work/commit.txt" 2>/dev/null
step tokenizer 60 python3 scripts/synthetic_tokenizer.py "$work/tokenizer" --vocab-size 163840
MODEL=(--model moonlight-16b-a3b --load-format dummy --dtype bfloat16 --tokenizer "$work/tokenizer")
python3 -m moeserve serve "${MODEL[@]}" --max-model-len 2048 --host 127.0.0.1 --port 8012 > "$work/serve.log" 2>&1 &
server=$!
step ready 240 python3 -m moeserve wait-ready --url http://127.0.0.1:8012 --timeout 230
SCHEMA='{"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "array", "items":
  {"type": "object", "properties": {"day": {"type": "integer"}, "note": {"type": "string"}}, "required": ["day", "note"]}}},
  "required": ["city", "days"]}'
BODY="{\"response_format\": {\"type\": \"json_schema\", \"json_schema\": {\"name\": \"plan\", \"strict\": true, \"schema\": $SCHEMA}}}"
for c in 1 32; do
  for mode in plain schema; do
    extra=()
    [ $mode = schema ] && extra=(--extra-body "$BODY")
    step "${mode}_c$c" 100 python3 -m moeserve bench --url http://127.0.0.1:8012 --concurrency $c --num-prompts $((4 * c)) \
      --input-len 256 --output-len "${OUTPUT_LEN:-128}" --vocab 100000 "${extra[@]}" --result-dir "$work/${mode}_c$c"
  done
done
kill -TERM $server; wait $server
for c in 1 32; do
  for mode in plain schema; do
    echo "${mode}_c$c:" >> "$work/summary.txt"
    grep -h "│ *[0-9]\|^| *[0-9]" "$work/${mode}_c$c.log" | head -2 >> "$work/summary.txt"
  done
done
pack
