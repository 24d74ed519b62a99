#!/usr/bin/env bash
# One device call on `nvidia-h200-x2` for issue 8, inside the 10-minute limit of a call: NCCL
# correctness of the two-GPU layouts against one GPU (float32 must be exact), then the serving
# sweep of tp2 / pp2 / ep2 next to the planner (carry the wheels of fetch_server_wheels.sh as
# `.whl`). Everything is packed into one archive (the device returns at most 8 files).
#   run (kind nvidia-h200-x2): bash scripts/gpu_session.sh x2 $OUT
source "$(dirname "$0")/steps.sh"
nvidia-smi -L > "$work/gpu.txt" 2>&1
step layouts_fp32 240 python3 scripts/layouts_check.py --out "$work/layouts_fp32" --layouts tp2,pp2,ep2 \
  --dtype float32 --tokens 16
if ls .whl/*.whl > /dev/null 2>&1; then
  step sweep 300 bash scripts/sweeps/gpu_sweep.sh "$work/sweep" tp2,pp2,ep2 1,32,128
fi
grep -h -A6 "^layout" "$work/layouts_fp32.log" >> "$work/summary.txt" 2>/dev/null
pack
