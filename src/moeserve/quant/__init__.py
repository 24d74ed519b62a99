"""Weight formats: how a quantized checkpoint's tensors are laid out, checked and dequantized.

``int4`` is compressed-tensors ``pack-quantized`` (Kimi K2.x routed experts); ``fp8`` is
DeepSeek-V3's FP8 with 128 x 128 block scales (every linear but lm_head), ``fp8_layout`` the
integer rule of how a rank stores its FP8 shard (shared with the planner, torch-free). Each
format module is plain torch (no Triton), so references, loaders and tests share one definition
of the format; ``experts`` (routed experts) and ``linear`` (the linear layers) hold the
per-layer slots (weight creation, loading, apply) that the layers call.
"""
