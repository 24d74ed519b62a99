#!/usr/bin/env bash
# The bf16 fused-MoE tile sweep at the token counts a server's steps have (Moonlight shape), then
# the ready check of scripts/gpu_session.sh ready (cold Triton cache, concurrency 1 with 16
# prompts and 32). Needs the wheels as `.whl`.
#   run: bash scripts/gpu_session.sh tiles $OUT
TILES=1 C1_PROMPTS=${C1_PROMPTS:-16} exec bash "$(dirname "$0")/ready.sh" "$@"
