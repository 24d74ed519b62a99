#!/usr/bin/env bash
# One device call for sampling at the cost of greedy (issue 34): the sampler with and without a sort
# against greedy (scripts/sweeps/sampler_bench.py: per vocabulary, configuration and batch, with the
# GPU's kept-set check; then seeded rows), the sampler's kernel tests at real shapes and the no-sync
# tests, and Moonlight offline decode (dummy bf16, batch 1/64/256) greedy against temperature 0.8 +
# top-p 0.95 + top-k 50 and against top-p 0.95 alone (2026-12-03, before: 0.88-0.91x greedy).
# The sampled modes run MOESERVE_SAMPLER=torch (torch.topk candidates; a sort for top-p alone); the
# *_triton ones MOESERVE_SAMPLER=triton (kernels/logit_filter.py, the default on a GPU since 2026-12-06).
#   env: MODES="greedy topkp topp topkp_triton" (the offline runs), OFFLINE_S=75 (each one's limit)
#   run: bash scripts/gpu_session.sh sampling $OUT
source "$(dirname "$0")/steps.sh"
cp COMMIT "$work/commit.txt" 2>/dev/null || git log -1 --format="commit %H %s" > "$work/commit.txt" 2>/dev/null
step bench 110 python3 scripts/sweeps/sampler_bench.py --out "$work/sampler_bench.json"
step bench_seeded 30 python3 scripts/sweeps/sampler_bench.py --seeded --vocabs 163840 --configs k50-p0.95-t0.8,p0.95 --no-check
step tests 90 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_logit_filter.py tests/kernels/test_sampling_kernel.py \
  tests/engine/test_sampler_filter.py
step no_sync 30 python3 -m pytest -q -p no:cacheprovider tests/engine/test_logit_adjust.py -k never_waits
MODES=${MODES:-greedy topkp topp topkp_triton}
for mode in $MODES; do
  case ${mode%_triton} in
    greedy) flags=(--temperature 0) ;;
    topkp) flags=(--temperature 0.8 --top-p 0.95 --top-k 50) ;;
    topp) flags=(--temperature 1.0 --top-p 0.95) ;;
  esac
  sampler=torch
  [ "$mode" != "${mode%_triton}" ] && sampler=triton
  step "offline_$mode" "${OFFLINE_S:-75}" env MOESERVE_SAMPLER=$sampler python3 -m moeserve bench --offline --model moonlight-16b-a3b --load-format dummy \
    --dtype bfloat16 --batch-sizes 1,64,256 --input-len 128 --output-len 64 "${flags[@]}" --result-dir "$work/offline_$mode"
done
sed -n '/^config/,$p' "$work/bench.log" >> "$work/summary.txt" 2>/dev/null
tail -n 4 "$work/bench_seeded.log" "$work/tests.log" "$work/no_sync.log" >> "$work/summary.txt" 2>/dev/null
for mode in $MODES; do
  echo "offline_$mode:" >> "$work/summary.txt"
  grep -h "│ *[0-9]" "$work/offline_$mode.log" | head -3 >> "$work/summary.txt"
done
pack
