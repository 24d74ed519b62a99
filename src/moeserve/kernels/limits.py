"""Batch sizes at which the fast path switches kernels: one source for every layer and kernel.

Plain constants (no Triton), so the torch-only layers read them without importing a kernel."""

# Dense projections of up to this many tokens go to the Triton GEMV (``kernels.gemv``) instead
# of cuBLAS: at decode the weight read dominates and a GEMV streams it at full bandwidth.
GEMV_MAX_TOKENS = 4

# T*K (token, expert) pairs up to this go to the MoE GEMV kernels (batch <= 4 at K = 8); beyond
# it two tokens often share an expert and the aligned grouped GEMM reads each expert once.
GEMV_MAX_PAIRS = 32

# INT4 (W4A16) experts: the GEMV reads each (token, slot)'s expert, the grouped GEMM each touched
# expert once but dequantizes at ~4 instructions a weight. Measured on one H200 at Kimi K2.6's
# layouts (scripts/sweeps/moe_kernel_bench.py --sweep, BENCHMARKS.md, 2026-12-03): the GEMV was faster
# up to 16 tokens on every TP slice (TP8, 16 tokens: 192 vs 291 us; TP1 equal), so up to 128 pairs.
INT4_GEMV_MAX_PAIRS = 128

# DeepSeek-V3 / R1 FP8 weights carry one scale per 128 x 128 block: the FP8 kernels are built
# for it, and quant.fp8_layout / kernels.fp8_ref lay out and dequantize shards on that grid.
FP8_BLOCK = 128

# MLA attention to a cached prefix (attention/triton_mla.py, MOESERVE_MLA_PREFIX=auto): the
# absorbed prefix form up to this many new tokens in the step's largest run of rows over one
# prefix, expanded pieces beyond. By FLOPs the two forms break even near 170 new tokens a run
# (absorbed: ~35 kFLOP per query and prefix token at 16 heads; chunked: ~10 kFLOP plus ~4.2 MFLOP
# to expand each prefix token once, for the whole run); below that the absorbed form also saves
# the pieces' gathers, expansions and merges (on one H200, 128 new tokens over 4,096 cached: 49.5 against 75.5 ms for the eager step).
ABSORBED_MAX_NEW_TOKENS = 160

# Rows that add a few tokens each at the front of a step (a decoding sequence's last accepted token
# and its speculative drafts) take the absorbed decode kernel with the row's tokens as extra query
# rows (``mla_decode(tokens_per_row=q)``, causal within the row) instead of the extend path's
# expansion, extend kernel, absorbed prefix pass and merge: one pass over the row's cache for all
# its queries, and metadata that is a view of the step's tensors (graph-capturable). Up to this
# many tokens a row (k = 7 drafts); longer leading rows are prompt chunks and stay extends.
DECODE_MAX_TOKENS_PER_ROW = 8
