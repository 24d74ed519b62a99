#!/usr/bin/env bash
# One device call for speculative decoding (issue 35) and the humming engine test (issue 29):
#   - the demo model served (`moeserve serve`, no --model) without and with its MTP layer drafting 2
#     tokens, `moeserve bench --url` at concurrency 1 and 32 on 64 held-out demo chat prompts;
#   - DeepSeek-V3 (5 layers, dummy FP8) offline at batch 1/8/32 with MTP k = 0..3 (dummy weights:
#     acceptance near zero, so the figure is a verify step's cost against a plain step);
#   - tests/kernels/test_humming_moe.py's engine test (humming vs Triton prompt logprobs).
#   needs: the server wheels, humming-kernels, compressed-tensors (.whl carried and installed first)
#   run: bash scripts/gpu_session.sh spec $OUT   (MODES="mtp2" SKIP_HUMMING=1: only the MTP parts; MODES="": nothing served;
#        MTP_LAYERS="4 7" MTP_BATCHES=1,8 MTP_K=0,1,2: the offline table at two depths ("": none);
#        SPEC_PROFILE=1: scripts/profile/spec_profile.py of a demo k = 2 and a V3 k = 1 step;
#        DEMO_CONCURRENCY="1": the served demo at c1 only; SPEC_TESTS=1: the GPU tests of the verify
#        and draft graphs first; MTP_MOONLIGHT=1: also Moonlight (all 27 layers, dummy bf16) with a
#        dummy MTP layer added, the issue's second shape)
source "$(dirname "$0")/steps.sh"
cp COMMIT "$work/commit.txt" 2>/dev/null || git log -1 --format="commit %H %s" > "$work/commit.txt" 2>/dev/null
[ -n "${SPEC_TESTS:-}" ] && step spec_tests ${TEST_S:-300} python3 -m pytest -q -p no:cacheprovider \
  tests/kernels/test_kernels_mla.py tests/spec/test_spec_graphs.py -k "several_tokens or verify or cuda or gpu"
URL=http://127.0.0.1:8014
python3 -c "import json; from moeserve.demo.tasks import held_out_tasks
for s in held_out_tasks(64): print(json.dumps({'prompt': s.prompt()}))" > "$work/demo_prompts.jsonl"
for mode in ${MODES-plain mtp2}; do
  flags=(); [ $mode = mtp2 ] && flags=(--speculative-config '{"method": "mtp", "num_speculative_tokens": 2}')
  python3 -m moeserve serve "${flags[@]}" --host 127.0.0.1 --port 8014 > "$work/server_$mode.log" 2>&1 &
  server=$!
  step "ready_$mode" 90 python3 -m moeserve wait-ready --url $URL --timeout 85
  for c in ${DEMO_CONCURRENCY:-1 32}; do
    step "demo_${mode}_c$c" 40 python3 -m moeserve bench --url $URL --dataset "$work/demo_prompts.jsonl" \
      --concurrency $c --num-prompts $((c == 1 ? 16 : 64)) --output-len 64 --result-dir "$work/demo_${mode}_c$c"
  done
  curl -s $URL/metrics | grep "spec_decode" | grep -v "^#" > "$work/metrics_$mode.txt"
  kill -TERM $server; wait $server
done
# MTP_LAYERS="4 7": two depths (1 and 4 MoE layers after V3's 3 dense ones), so a step's cost splits
# into a per-MoE-layer part and the rest, and projects to the full 61 layers.
for layers in ${MTP_LAYERS-5}; do
  step mtp_v3_l$layers ${MTP_S:-150} python3 -m moeserve bench --offline --model deepseek-v3 --load-format dummy \
    --hf-overrides "{\"num_hidden_layers\": $layers}" --batch-sizes ${MTP_BATCHES:-1,8,32} --input-len 512 --output-len 64 \
    --speculative-config '{"method": "mtp"}' --num-speculative-tokens ${MTP_K:-0,1,2,3} --result-dir "$work/mtp_l$layers"
done
if [ -n "${MTP_MOONLIGHT:-}" ]; then
  step mtp_moonlight ${MTP_S:-150} python3 -m moeserve bench --offline --model moonlight-16b-a3b --load-format dummy \
    --dtype bfloat16 --hf-overrides '{"num_nextn_predict_layers": 1}' --batch-sizes ${MTP_BATCHES:-1,8,32} --input-len 512 \
    --output-len 64 --speculative-config '{"method": "mtp"}' --num-speculative-tokens ${MTP_K:-0,1,2,3} --result-dir "$work/mtp_moonlight"
fi
if [ -n "${SPEC_PROFILE:-}" ]; then  # where a step goes: the demo model at k = 2, V3 (5 layers) at k = 1, batch 1
  step profile_demo_k2 90 python3 scripts/profile/spec_profile.py --model '' --k 2 --batch 1
  step profile_v3_k1 120 python3 scripts/profile/spec_profile.py --k 1 --batch 1
fi
[ -n "${SKIP_HUMMING:-}" ] || step humming_engine ${TEST_S:-100} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_humming_moe.py -k engine
for f in "$work"/demo_*.log; do echo "$(basename "$f"): $(grep -h '^| [0-9]' "$f" | head -1)" >> "$work/summary.txt"; done
cat "$work"/metrics_*.txt >> "$work/summary.txt"
[ -f "$work/spec_tests.log" ] && { tail -3 "$work/spec_tests.log"; grep -h "^FAILED\|Error" "$work/spec_tests.log" | head; } >> "$work/summary.txt"
for f in "$work"/mtp_v3_l*.log "$work"/mtp_moonlight.log; do [ -f "$f" ] || continue; echo "== $(basename "$f")" >> "$work/summary.txt"; grep -h "accepted\|^│\|^┃" "$f" | tail -30 >> "$work/summary.txt"; done
for f in "$work"/profile_*.log; do [ -f "$f" ] && { echo "== $(basename "$f")" >> "$work/summary.txt"; head -30 "$f" >> "$work/summary.txt"; }; done
[ -f "$work/humming_engine.log" ] && tail -3 "$work/humming_engine.log" >> "$work/summary.txt"
pack
