"""Triton kernels (and one in CUDA C), each in its own module beside its plain-PyTorch reference.

=====================  ==========================================  ================================
module                 kernel (wrapper)                            reference
=====================  ==========================================  ================================
``mla_decode``         paged MLA decode over the latent cache,     ``mla_decode_ref``
                       weight-absorbed, split-K (flash-decoding),
                       a block of heads per program (``mla_decode``)
``mla_extend``         causal ragged-batch attention for prefill / ``mla_extend_ref``
                       extend, non-absorbed (``mla_extend``)
``fused_moe``          routed experts: align pairs by expert, two  ``fused_moe_ref``
                       grouped GEMMs (SiLU*up and the top-k weight (= ``kernels.moe_ref.moe_experts_ref``)
                       fused), combine (``fused_moe``)
``moe_align``          the (token, expert) pairs grouped by local  ``align_pairs_by_expert_ref``
                       expert in BLOCK_M-aligned runs for the
                       grouped GEMMs, three launches, no host sync
                       (``align_pairs_by_expert``)
``moe_gemv``           routed + shared experts for <= 32 (token,   ``kernels.moe_ref.moe_experts_ref``
                       expert) pairs: two GEMV kernels, no         + the shared ``DenseMLP``
                       alignment, the sum inside (``moe_gemv``)
``int4_moe``           INT4 (W4A16, compressed-tensors pack-       ``int4_moe_ref``
                       quantized) routed experts: the GEMV pair    (= ``moe_experts_by_expert`` +
                       of ``moe_gemv`` with shared experts         ``quant.int4.dequantize_int4``)
                       (``int4_moe_gemv``) and the grouped GEMMs
                       of ``fused_moe`` (``int4_fused_moe``),
                       nibbles unpacked in registers
``int4_spread``        the INT4 GEMV spread over the GPU for an EP ``int4_moe_ref``
                       rank's few local experts and TP slices
                       (``int4_moe_gemv_spread``; opt-in:
                       measured slower but for an EP8
                       rank's lone expert at one token)
``int4_gemv_cuda``     the INT4 decode GEMV in CUDA C              ``int4_moe_ref``
                       (``cuda/int4_gemv.cu``, compiled by NVRTC;
                       ``int4_moe_gemv_cuda``, with the shared experts;
                       the default decode GEMV,
                       ``MOESERVE_INT4_GEMV``)
``rmsnorm``            RMSNorm, and residual add + RMSNorm in one  ``rmsnorm_ref``,
                       pass (``rmsnorm``, ``fused_add_rmsnorm``)   ``fused_add_rmsnorm_ref``
``router``             expert choice: router GEMV, scores, bias,   ``layers.moe.Router`` (torch)
                       groups, top-k, normalise (``route_hidden``,
                       ``route``, ``router_logits``)
``rope_cache``         rope of q and k, RMSNorm of the latent, the ``layers.rotary.RotaryEmbedding``
                       KV-cache write (``rope_and_cache``)         + ``StageKVPool.write``
``gemv``               dense projections of <= 4 tokens (``gemv``) ``F.linear``
``sampling``           argmax + logsumexp of a row of logits       ``argmax_logsumexp_ref``
                       (``argmax_logsumexp``)
``fp8_linear``         DeepSeek-V3 FP8 (128 x 128 block scales)    ``fp8_linear_ref``
                       linears: per-token, per-128-channel         (= ``quant.fp8`` dequantize
                       activation quantization + W8A8 GEMM on the  + ``F.linear``)
                       fp8 tensor cores, split K at <= 16 tokens
                       (``fp8_linear``)
``fp8_moe``            FP8 routed experts: the grouped W8A8 GEMMs  ``fp8_moe_ref``
                       of ``fused_moe`` (``fp8_fused_moe``) and    (= ``moe_experts_by_expert`` +
                       the GEMV pair of ``moe_gemv`` with FP8      ``quant.fp8`` dequantize)
                       shared experts (``fp8_moe_gemv``)
=====================  ==========================================  ================================

The model runner switches the layers to these kernels when the backend is ``triton`` (the
default on CUDA); ``backend="reference"`` keeps every layer on its torch code.

``attention.triton_mla.TritonMLABackend`` puts the two attention kernels behind the
``AttentionBackend`` interface. ``python -m moeserve.kernels.bench`` checks and times them
all on a GPU, printing each figure beside its bandwidth / compute bound.

Every wrapper takes tensors on any device: on a machine without a GPU the kernels run under
Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton is imported), which is how the
tests run in CI at tiny shapes. Importing a kernel module needs Triton; this package's
``__init__`` imports nothing, so ``moeserve`` itself never does.

Shapes come from the tensors handed in (never from a fixed layer), tile sizes from small
documented heuristics in each module (``decode_config`` / ``default_num_kv_splits``,
``extend_config``, ``moe_config``), each overridable with a ``config=`` dict.
"""
