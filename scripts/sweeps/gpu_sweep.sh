#!/usr/bin/env bash
# On the GPU machine: a `moeserve sweep` of what fits one H200 (Moonlight-16B-A3B shape, dummy
# weights), measured next to the planner. Needs the wheels from scripts/fetch_server_wheels.sh
# carried as `.whl`. Usage: bash scripts/sweeps/gpu_sweep.sh OUT_DIR [LAYOUTS] [CONCURRENCY]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:?output dir}; layouts=${2:-tp1}; levels=${3:-1,32,128}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1
python3 -c "import moeserve.server.app" || { echo "the server cannot be imported here (a missing wheel?)"; exit 1; }
python3 -m moeserve sweep --model moonlight-16b-a3b --layouts "$layouts" --concurrency "$levels" \
  --num-prompts 128 --input-len 1024 --output-len 128 --vocab 100000 --gpu h200 --result-dir "$out" \
  -- --load-format dummy --dtype bfloat16 --max-model-len 2048 --max-num-seqs 256
