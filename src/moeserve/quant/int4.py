"""compressed-tensors ``pack-quantized`` INT4: symmetric, group-wise along the input dimension.

A weight ``[out, in]`` is stored as
  ``weight_packed`` int32 ``[out, in / 8]``: element k of a row lives in word k // 8 at bits
  4 * (k % 8) .. 4 * (k % 8) + 3, stored as ``q + 8`` for q in [-8, 7];
  ``weight_scale`` ``[out, in / group]`` (bf16 as published);
  ``weight_shape`` ``[2]`` = (out, in).
w[n, k] = q[n, k] * scale[n, k // group].
"""

from __future__ import annotations

# The references (pack, unpack, dequantize, the kernels' word order) live beside the kernels.
from moeserve.kernels.int4_ref import (  # noqa: F401 (re-exported)
    KERNEL_SLOT_ELEMENT,
    PACK,
    checkpoint_words,
    dequantize_int4,
    kernel_words,
    pack_int4,
    quantize_int4,
    unpack_int4,
)

GROUP_SIZE = 32  # the one group size the kernels are built for (Kimi K2.x as published)


def check_pack_quantized(q) -> None:
    """Raise a ValueError naming the scheme unless ``q`` (a ``QuantizationConfig``) is the INT4
    scheme the engine runs: compressed-tensors ``pack-quantized``, 4-bit symmetric int weights,
    group strategy of 32 input columns, no activation reordering, one config group."""
    scheme = (
        f"format={q.format!r}, num_bits={q.weight_bits}, type={q.weight_type!r}, strategy={q.strategy!r}, "
        f"group_size={q.group_size}, symmetric={q.symmetric}, actorder={q.actorder!r}"
    )
    supported = (
        "moeserve runs compressed-tensors format='pack-quantized', num_bits=4, type='int', "
        f"strategy='group', group_size={GROUP_SIZE}, symmetric=True, actorder=None"
    )
    ok = (
        q.format == "pack-quantized"
        and q.weight_bits == 4
        and q.weight_type == "int"
        and q.strategy in ("group", None)
        and q.group_size == GROUP_SIZE
        and q.symmetric
        and q.actorder in (None, False, "none")
        and q.num_groups == 1
    )
    if not ok:
        extra = f", {q.num_groups} config groups" if q.num_groups != 1 else ""
        raise ValueError(f"unsupported compressed-tensors scheme ({scheme}{extra}); {supported}")
