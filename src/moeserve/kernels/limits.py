"""Batch sizes at which the fast path switches kernels: one source for every layer and kernel.

Plain constants (no Triton), so the torch-only layers read them without importing a kernel."""

# Dense projections of up to this many tokens go to the Triton GEMV (``kernels.gemv``) instead
# of cuBLAS: at decode the weight read dominates and a GEMV streams it at full bandwidth.
GEMV_MAX_TOKENS = 4

# T*K (token, expert) pairs up to this go to the MoE GEMV kernels (batch <= 4 at K = 8); beyond
# it two tokens often share an expert and the aligned grouped GEMM reads each expert once.
GEMV_MAX_PAIRS = 32
