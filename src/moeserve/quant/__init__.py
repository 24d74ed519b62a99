"""Weight formats: how a quantized checkpoint's tensors are laid out, checked and dequantized.

``int4`` is compressed-tensors ``pack-quantized`` (Kimi K2.x routed experts). Each format module
is plain torch (no Triton), so references, loaders and tests share one definition of the format;
``methods`` holds the per-layer slots (weight creation, loading, apply) that the layers call.
"""
