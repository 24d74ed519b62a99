"""Routed INT4 experts through humming (``humming-kernels``, the W4A16 GEMM library vLLM's MoE path
uses): the optional backend of ``quant.experts.Int4Experts`` (``--moe-backend``), chosen once at
start-up where it is installed and finds nvcc for its JIT.

The op, as vLLM's indexed path runs it:

    align the (token, k) pairs by local expert in runs of the GEMM's tile M (``kernels.moe_align``,
    three Triton launches) -> indexed gate_up GEMM over the T tokens (top_k = K) -> SiLU(gate) * up
    (humming's fused input kernel) -> times the routing weight -> indexed down GEMM over the T*K
    pair rows (top_k = 1) -> the K rows of a token summed -> [T, H].

Weights. moeserve keeps compressed-tensors ``pack-quantized`` INT4 (nibble = q + 8, symmetric,
group 32) in its own nibble order (``quant.int4.kernel_words``); the caller hands the checkpoint's
words (``quant.int4.checkpoint_words``), which humming reads as the schema vLLM loads such
checkpoints with, and humming repacks them and the scales once into its kernels' layout: the same
int4 values and scales, nothing dequantized. The two layouts are not both kept (the experts are most
of a model's memory): the layer drops its packed words once this object holds humming's.

Kernels. humming's heuristic gives, per GEMM, a list of (rows interval, tile) for this shape; the
whole list goes to every call, so the first call compiles all of them at once (nvcc, in parallel,
cached on disk under ``HUMMING_CACHE_DIR``, default ``~/.humming/cache``) and each later call picks
the interval of its ``valid_shape_m`` on the device. The alignment's block is that interval's tile
M, looked up on the host from the token count alone: no host sync, so the op is captured in CUDA
graphs. ``valid_shape_m`` is T*K, or under expert parallelism vLLM's estimate of this rank's pairs,
T*K*E_local/E_total.

Nothing from humming is imported until :func:`available` or :class:`HummingInt4Experts` is called.
Leaf module: imports torch and ``kernels.moe_align``.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
from dataclasses import dataclass

import torch
import torch.nn.functional as F

GROUP = 32  # scale group along the input dimension (Kimi K2.x as published)
PACK = 8  # nibbles per int32 word
_COMPUTE_CONFIG = json.dumps({"gemm_type": "indexed"})
# humming's fused activation (process_input, binary_split): a = gate column, b = up column, in fp32.
_SILU_MUL = "a / (1.0f + expf(-a)) * b"
_LOCK_WORDS = 8192  # stream-K lock counters per GEMM (humming's own layer keeps 2048, vLLM 1024)
DTYPES = (torch.bfloat16, torch.float16)  # the activation dtypes humming's W4A16 kernels take


def available(device: torch.device | None = None) -> str | None:
    """None when humming can run here (it imports, a CUDA device, nvcc for its JIT), else why not."""
    if device is not None and device.type != "cuda":
        return f"humming runs on CUDA devices, not {device.type}"
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import humming.forward  # noqa: F401
        from humming.utils.cuda import filter_cuda_paths
    except Exception as e:  # any import failure (absent, built for another torch) means "not available"
        return f"humming-kernels cannot be imported ({type(e).__name__}: {str(e)[:200]}); pip install humming-kernels"
    try:
        filter_cuda_paths(required_binaries=["nvcc"])  # humming's own lookup (the CUDA major of torch)
    except Exception as e:
        if shutil.which("nvcc") is None:
            return f"humming finds no nvcc for its JIT compiler: {e}"
    return None


class _Gemm:
    """One expert-stacked W4A16 projection (``N`` output rows, ``K`` input columns) in humming's layout."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        from humming.forward import humming_forward
        from humming.schema.compressed_tensors import CompressedTensorsWeightSchema
        from humming.transform import prepare_and_transform_humming_tensors
        from humming.tune import get_heuristics_config

        E, N, words = packed.shape
        K = words * PACK
        device = packed.device
        checkpoint = CompressedTensorsWeightSchema(
            format="pack-quantized", type="int", num_bits=4, strategy="group", group_size=GROUP, symmetric=True
        )
        schema, tensors = checkpoint.convert_humming(
            tensors={"weight_packed": packed.contiguous(), "weight_scale": scale.contiguous()},
            shape_n_stacks=[N],
            shape_k_stacks=[K],
            param_dtype=dtype,
            num_experts=E,
            device=device,
        )
        self.config, tensors = prepare_and_transform_humming_tensors(
            tensors,
            shape_n=N,
            shape_k=K,
            weight_schema=schema,
            num_experts=E,
            pad_n_to_multiple=256,
            pad_k_to_multiple=128,
            torch_dtype=dtype,
            device=device,
        )
        self.weight = tensors["weight"]
        self.weight_scale = tensors["weight_scale"]
        self.zero_point = tensors.get("zero_point")
        self.weight_scale_2 = tensors.get("weight_scale_2")
        # [[min_m, max_m, tile config], ...]: the kernel for min_m < valid_shape_m <= max_m.
        self.intervals = get_heuristics_config(self.config, gemm_type="indexed", device=device)
        self.all_tunings = json.dumps(self.intervals)
        self.locks = torch.zeros(_LOCK_WORDS, dtype=torch.int32, device=device)
        self._forward = humming_forward

    def tile_m(self, valid_shape_m: int) -> int:
        """The M tile of the kernel humming launches for ``valid_shape_m`` rows (the alignment block)."""
        config = next(c for lo, hi, c in self.intervals if lo < valid_shape_m <= hi)
        return int(config["block_shape"][0])

    def __call__(self, inputs: torch.Tensor, outputs: torch.Tensor, blocks: Blocks, top_k: int, valid_shape_m: int) -> None:
        """``outputs[p] = W[expert of p's block] @ inputs[p // top_k]`` for every pair id p in the first
        ``padded_rows`` rows of ``sorted_pairs``; padding ids (``>= rows of outputs``) are skipped."""
        self._forward(
            self.config,
            inputs=inputs,
            weight=self.weight,
            weight_scale=self.weight_scale,
            zero_point=self.zero_point,
            weight_scale_2=self.weight_scale_2,
            outputs=outputs,
            sorted_ids=blocks.sorted_pairs,
            expert_ids=blocks.block_expert,
            num_tokens_padded=blocks.padded_rows,
            locks=self.locks,
            top_k=top_k,
            valid_shape_m=valid_shape_m,
            compute_config=_COMPUTE_CONFIG,
            tuning_config=self.all_tunings,
        )


@dataclass(frozen=True)
class Blocks:
    """One GEMM's view of a batch's pairs grouped by local expert (``kernels.moe_align``'s contract)."""

    sorted_pairs: torch.Tensor  # [capacity] int32 pair ids, padding rows T*K
    block_expert: torch.Tensor  # [capacity // tile M] int32 local expert of each block (-1 past the runs)
    padded_rows: torch.Tensor  # [1] int32 rows in use


class HummingInt4Experts:
    """W4A16 group-32 routed experts of one layer, in humming's layout.

    ``w13_packed [E, 2I, H/8]`` / ``w2_packed [E, H, I/8]`` int32 words in the checkpoint's nibble order,
    scales ``[E, rows, cols/32]`` in the activation dtype (bf16 or fp16). ``total_experts``: the
    model's routed experts (all ranks'); it sizes humming's kernel choice under expert parallelism."""

    def __init__(
        self,
        w13_packed: torch.Tensor,
        w13_scale: torch.Tensor,
        w2_packed: torch.Tensor,
        w2_scale: torch.Tensor,
        total_experts: int,
    ) -> None:
        E, two_i, hidden_words = w13_packed.shape
        self.num_local, self.inter, self.hidden = E, two_i // 2, hidden_words * PACK
        H, I = self.hidden, self.inter
        for name, t, shape in [
            ("w13_scale", w13_scale, (E, 2 * I, H // GROUP)),
            ("w2_packed", w2_packed, (E, H, I // PACK)),
            ("w2_scale", w2_scale, (E, H, I // GROUP)),
        ]:
            if tuple(t.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
        if w13_packed.dtype != torch.int32 or w2_packed.dtype != torch.int32:
            raise ValueError("packed INT4 weights must be int32 words")
        if w13_scale.dtype not in DTYPES:
            raise ValueError(f"humming's INT4 kernels take bf16 or fp16 activations (the scales' dtype), not {w13_scale.dtype}")
        self.dtype, self.device = w13_scale.dtype, w13_packed.device
        self.total_experts = total_experts
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            self.w13 = _Gemm(w13_packed, w13_scale, self.dtype)  # N = 2I, K = H
            self.w2 = _Gemm(w2_packed, w2_scale, self.dtype)  # N = H, K = I
        self._fused_activation = None  # humming's SiLU-and-mul, once it has matched torch (use_fused_activation)

    def use_fused_activation(self) -> str | None:
        """Switch SiLU(gate) * up to humming's fused kernel if it compiles and matches torch on a small
        batch; None when switched, else why not (the two torch kernels stay)."""
        I = self.inter
        try:
            from humming.ops import process_input

            g = torch.randn(8, 2 * I, dtype=self.dtype, device=self.device)
            out = torch.empty(8, I, dtype=self.dtype, device=self.device)
            process_input(g, outputs=out, activation_type="binary_split", activation_impl=_SILU_MUL)
            ref = F.silu(g[:, :I].float()) * g[:, I:].float()
            torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
        except Exception as e:  # any failure keeps torch's, and says why
            return f"{type(e).__name__}: {str(e)[:200]}"
        self._fused_activation = process_input
        return None

    def valid_shape_m(self, num_tokens: int, top_k: int) -> int:
        pairs = num_tokens * top_k
        return max(1, math.ceil(pairs * self.num_local / self.total_experts))

    def align(self, topk_ids: torch.Tensor, first_expert: int, tile_m: int) -> Blocks:
        from moeserve.kernels.moe_align import align_pairs_by_expert, align_pairs_by_expert_ref

        align = align_pairs_by_expert if topk_ids.is_cuda else align_pairs_by_expert_ref
        return Blocks(*align(topk_ids, self.num_local, first_expert, tile_m, with_rows=True))

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, first_expert: int) -> torch.Tensor:
        """``[T, H]``: the sum over each token's local experts (ids in ``[first_expert, first_expert + E)``;
        the others contribute nothing) of ``topk_weight * down(silu(gate(x)) * up(x))``."""
        T, K = topk_ids.shape
        H, I, P = self.hidden, self.inter, topk_ids.numel()
        if x.dtype != self.dtype:
            raise ValueError(f"humming experts hold {self.dtype} scales; the activations are {x.dtype}")
        if T == 0:
            return x.new_zeros(0, H)
        m = self.valid_shape_m(T, K)
        tile_gu, tile_dn = self.w13.tile_m(m), self.w2.tile_m(m)
        blocks_gu = self.align(topk_ids, first_expert, tile_gu)
        blocks_dn = blocks_gu if tile_dn == tile_gu else self.align(topk_ids, first_expert, tile_dn)
        kw = dict(dtype=self.dtype, device=x.device)
        gate_up = torch.empty(P, 2 * I, **kw)  # rows of other ranks' pairs stay unwritten (never read below)
        self.w13(x.contiguous(), gate_up, blocks_gu, K, m)
        act = torch.empty(P, I, **kw)
        if self._fused_activation is not None:
            self._fused_activation(gate_up, outputs=act, activation_type="binary_split", activation_impl=_SILU_MUL)
        else:
            torch.mul(F.silu(gate_up[:, :I]), gate_up[:, I:], out=act)
        act.mul_(topk_weights.reshape(P, 1))  # the routing weight before down (down is linear)
        # The down GEMM writes only this rank's pairs: the others' rows must read as zero in the sum.
        all_local = self.num_local == self.total_experts
        down = (torch.empty if all_local else torch.zeros)(P, H, **kw)
        self.w2(act, down, blocks_dn, 1, m)
        return down.view(T, K, H).sum(dim=1)


__all__ = ["DTYPES", "HummingInt4Experts", "available"]
