#!/usr/bin/env bash
# Where the host spends a lone prefill step: the prefill profile with --host (enqueue time and
# cProfile) at 256 / 1024 tokens, and the cost of one launch of a Triton kernel and of a torch op.
#   run: bash scripts/gpu_session.sh host $OUT
source "$(dirname "$0")/steps.sh"
export PYTHONPATH=$PWD/src
cp COMMIT "$work/commit.txt" 2>/dev/null || git log -1 --format="commit %H %s" > "$work/commit.txt" 2>/dev/null
step launch_cost 60 python3 scripts/profile/launch_cost.py
step host_profile 90 python3 scripts/profile/prefill_profile.py --lengths 256,1024 --host --top 40
grep -h "per launch\|^## prompt\|host enqueue" "$work"/launch_cost.log "$work"/host_profile.log >> "$work/summary.txt" 2>/dev/null
pack
