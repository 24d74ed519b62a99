"""Benchmark peer, not used by the server: moeserve's W4A16 group-32 routed experts run through humming
(``humming-kernels``, vLLM's JIT-compiled quantized GEMM library) the way vLLM's humming MoE path
(``HummingIndexedExperts``) runs them:

    align the (token, k) pairs by local expert in runs of the GEMM's tile M
    -> indexed gate_up GEMM (top_k = K) -> SiLU(gate) * up -> indexed down GEMM over the T*K rows
    (top_k = 1) -> top-k weighted sum -> [T, H].

Weights. moeserve's packed experts are compressed-tensors ``pack-quantized`` (nibble = q + 8, symmetric,
group 32), a format humming reads as it is (``CompressedTensorsWeightSchema``, the schema vLLM loads such
checkpoints with): humming treats the nibbles as offset-binary uint4 codes (value = code - 8), re-encodes
them sign-magnitude when no code is -8, and repacks them and the scales once for its kernels in
``__init__``. No dequantization: the same int4 values and scales.

Kernels are chosen as vLLM chooses them: humming's heuristic tuning intervals for the layer, looked up at
``valid_shape_m`` (T*K, or vLLM's estimate of the local pairs under EP), the alignment block being that
kernel's tile M. Each (T, K) compiles its kernels (JIT) on its first call; after that a call allocates
only buffers sized by T and K and never syncs with the host, so it can be captured in a CUDA graph.

``align`` (torch, about 25 small launches) and ``experts`` are also callable apart, to time humming's
part without this file's torch alignment (vLLM aligns with one CUDA kernel).

Nothing from humming is imported at module import time; :func:`available` says whether it can run.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass

import torch
import torch.nn.functional as F

GROUP = 32  # scale group along the input dimension
PACK = 8  # nibbles per int32 word
_COMPUTE_CONFIG = json.dumps({"gemm_type": "indexed"})
# humming's fused activation (process_input, binary_split): a = gate column, b = up column, in fp32.
_SILU_MUL = "a / (1.0f + expf(-a)) * b"
_LOCK_WORDS = 8192  # stream-K lock counters per GEMM (humming's own layer keeps 2048, vLLM 1024)


def available() -> str | None:
    """None when humming imports and finds nvcc for its JIT, else why not."""
    try:
        import humming.forward  # noqa: F401
        from humming.utils.cuda import filter_cuda_paths
    except Exception as e:  # any import failure means "not available"
        return f"humming cannot be imported: {type(e).__name__}: {e}"
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        filter_cuda_paths(required_binaries=["nvcc"])  # humming's own lookup (CUDA major of torch)
    except Exception as e:
        if shutil.which("nvcc") is None:
            return f"no nvcc for humming's JIT: {e}"
    return None


class _HummingGemm:
    """One expert-stacked W4A16 layer (``N`` output rows, ``K`` input columns) in humming's layout."""

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
        # -> HummingWeightSchema (uint4 or sign-magnitude e0m3 codes, bf16 group scales); copies, never
        # writes the caller's tensors (allow_inplace defaults to False everywhere below).
        schema, tensors = checkpoint.convert_humming(
            tensors={"weight_packed": packed.contiguous(), "weight_scale": scale.contiguous()},
            shape_n_stacks=[N],
            shape_k_stacks=[K],
            param_dtype=dtype,
            num_experts=E,
            device=device,
        )
        # LayerConfig + kernel layout (repacked weight, permuted scales); padding as vLLM asks for it.
        self.config, self.tensors = prepare_and_transform_humming_tensors(
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
        # [[min_m, max_m, tuning config], ...]: the kernel for min_m < valid_shape_m <= max_m.
        self.intervals = get_heuristics_config(self.config, gemm_type="indexed", device=device)
        self.locks = torch.zeros(_LOCK_WORDS, dtype=torch.int32, device=device)
        self._forward = humming_forward
        self._tuning: dict[int, tuple[int, str]] = {}

    def tuning(self, valid_shape_m: int) -> tuple[int, str]:
        """(tile M, JSON tuning config) of the interval holding ``valid_shape_m``: the kernel vLLM's call
        launches. vLLM passes the whole list, which compiles every interval's kernel on the first call;
        passing the one config compiles only the kernels of the shapes actually run."""
        if valid_shape_m not in self._tuning:
            config = next(c for lo, hi, c in self.intervals if lo < valid_shape_m <= hi)
            self._tuning[valid_shape_m] = (int(config["block_shape"][0]), json.dumps(config))
        return self._tuning[valid_shape_m]

    def __call__(
        self,
        inputs: torch.Tensor,
        outputs: torch.Tensor,
        blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        top_k: int,
        valid_shape_m: int,
        tuning: str,
    ) -> None:
        """Indexed GEMM: ``outputs[p] = W[expert of p's block] @ inputs[p // top_k]`` for every pair id p in
        the first ``num_tokens_padded`` rows of ``sorted_ids``; the padding ids (>= T*K) are skipped."""
        sorted_ids, expert_ids, num_tokens_padded = blocks
        self._forward(
            self.config,
            inputs=inputs,
            weight=self.tensors["weight"],
            weight_scale=self.tensors["weight_scale"],
            zero_point=self.tensors.get("zero_point"),
            weight_scale_2=self.tensors.get("weight_scale_2"),
            outputs=outputs,
            sorted_ids=sorted_ids,
            expert_ids=expert_ids,
            num_tokens_padded=num_tokens_padded,
            locks=self.locks,
            top_k=top_k,
            valid_shape_m=valid_shape_m,
            compute_config=_COMPUTE_CONFIG,
            tuning_config=tuning,
        )


Blocks = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # sorted_ids, expert_ids, num_tokens_padded (int32)


@dataclass(frozen=True)
class Routing:
    """One batch's routing in humming's indexed-GEMM form (sizes depend on T and K only)."""

    num_tokens: int
    top_k: int
    valid_shape_m: int  # the row count humming picks its kernels by
    gate_up: Blocks
    down: Blocks  # the same tensors unless the two GEMMs' tiles differ in M
    gate_up_tuning: str
    down_tuning: str


class HummingInt4Moe:
    """W4A16 group-32 MoE through humming, built from moeserve's packed INT4 experts.

    ``global_num_experts``: the experts of all ranks, for expert parallelism. When given, humming picks its
    kernels for vLLM's estimate of this rank's pairs (T*K*E/global, as vLLM does); when it equals E no id can
    be another rank's and the down output needs no zero fill. Left None, ids of other ranks are allowed
    (zero fill) and kernels are picked for T*K rows."""

    def __init__(
        self,
        w13_packed: torch.Tensor,
        w13_scale: torch.Tensor,
        w2_packed: torch.Tensor,
        w2_scale: torch.Tensor,
        *,
        global_num_experts: int | None = None,
    ) -> None:
        E, two_i, hidden_words = w13_packed.shape
        self.num_experts, self.inter, self.hidden = E, two_i // 2, hidden_words * PACK
        H, I = self.hidden, self.inter
        for name, t, shape in [
            ("w13_scale", w13_scale, (E, 2 * I, H // GROUP)),
            ("w2_packed", w2_packed, (E, H, I // PACK)),
            ("w2_scale", w2_scale, (E, H, I // GROUP)),
        ]:
            if tuple(t.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
        if w13_packed.dtype != torch.int32 or w2_packed.dtype != torch.int32:
            raise ValueError("packed weights must be int32")
        if w13_scale.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"scales must be bf16 or fp16 (the activation dtype), not {w13_scale.dtype}")
        self.dtype = w13_scale.dtype
        self.device = w13_packed.device
        self.global_num_experts = global_num_experts
        with torch.cuda.device(self.device):
            self.w13 = _HummingGemm(w13_packed, w13_scale, self.dtype)  # N = 2I, K = H
            self.w2 = _HummingGemm(w2_packed, w2_scale, self.dtype)  # N = H, K = I
            self.activation_path = self._probe_activation()  # "humming", or "torch (why)"
        self._search_keys = torch.arange(E + 1, device=self.device)  # local experts 0..E

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, first_expert: int) -> torch.Tensor:
        """``[T, H]`` = sum over each token's chosen local experts (ids in ``[first_expert, first_expert + E)``;
        others contribute nothing) of ``topk_weight * down(silu(gate(x)) * up(x))``."""
        return self.experts(x, topk_weights, self.align(topk_ids, first_expert))

    # -- routing ----------------------------------------------------------------------------------

    def align(self, topk_ids: torch.Tensor, first_expert: int) -> Routing:
        """Group the flattened pairs ``p = t * K + k`` by local expert, each expert's run padded to the GEMM's
        tile M with the id ``T*K`` (which the GEMMs skip); other ranks' pairs are left out."""
        T, K = topk_ids.shape
        E, P = self.num_experts, topk_ids.numel()
        G = self.global_num_experts
        valid_shape_m = P if G is None else max(1, math.ceil(P * E / G))
        block_gu, tuning_gu = self.w13.tuning(valid_shape_m)
        block_dn, tuning_dn = self.w2.tuning(valid_shape_m)

        local = (topk_ids.reshape(-1).to(torch.int64) - first_expert).clamp_(max=E)
        local = torch.where(local < 0, E, local)  # local expert, E for another rank's (dropped)
        sorted_local, order = torch.sort(local, stable=True)  # order: pair ids, grouped by expert
        first = torch.searchsorted(sorted_local, self._search_keys)  # [E + 1] first sorted slot of each
        gate_up = self._blocks(sorted_local, order, first, block_gu)
        down = gate_up if block_dn == block_gu else self._blocks(sorted_local, order, first, block_dn)
        return Routing(T, K, valid_shape_m, gate_up, down, tuning_gu, tuning_dn)

    def _blocks(self, sorted_local: torch.Tensor, order: torch.Tensor, first: torch.Tensor, block_m: int) -> Blocks:
        E, P, dev = self.num_experts, order.numel(), order.device
        rows = -(-(P + min(P, E) * (block_m - 1)) // block_m) * block_m  # most padded rows any routing needs
        padded = (torch.diff(first) + (block_m - 1)) // block_m * block_m  # [E] rows of each expert's run
        run_end = torch.cumsum(padded, 0)
        # sorted slot i of expert e goes to row i + shift[e]; other ranks' pairs (e = E) past `rows`
        shift = F.pad(run_end - padded - first[:E], (0, 1), value=rows)
        dest = torch.arange(P, device=dev) + shift[sorted_local]
        sorted_ids = torch.full((rows + P,), P, dtype=torch.int32, device=dev)
        sorted_ids.scatter_(0, dest, order.to(torch.int32))
        block_start = torch.arange(0, rows, block_m, device=dev)
        # blocks past the last run are never read (the GEMM stops at num_tokens_padded); keep them in range
        expert_ids = torch.searchsorted(run_end, block_start, right=True).clamp_(max=E - 1).to(torch.int32)
        return sorted_ids[:rows], expert_ids, run_end[-1:].to(torch.int32)

    # -- experts ----------------------------------------------------------------------------------

    def experts(self, x: torch.Tensor, topk_weights: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The routed-expert op on an aligned batch: two humming GEMMs, the activation, the weighted sum."""
        T, K, H, I = routing.num_tokens, routing.top_k, self.hidden, self.inter
        P = T * K
        kw = dict(dtype=self.dtype, device=self.device)
        gate_up = torch.empty(P, 2 * I, **kw)  # rows of other ranks' pairs stay unwritten
        self.w13(x.contiguous(), gate_up, routing.gate_up, K, routing.valid_shape_m, routing.gate_up_tuning)
        act = torch.empty(P, I, **kw)
        if self.activation_path == "humming":
            self._process_input(gate_up, outputs=act, activation_type="binary_split", activation_impl=_SILU_MUL)
        else:
            torch.mul(F.silu(gate_up[:, :I]), gate_up[:, I:], out=act)
        act.mul_(topk_weights.reshape(P, 1))  # routing weight before down (linear); fp32 math if weights are fp32
        # The down GEMM writes only this rank's pairs: zero the rest unless every id is known to be local.
        all_local = self.global_num_experts == self.num_experts
        down = (torch.empty if all_local else torch.zeros)(P, H, **kw)
        self.w2(act, down, routing.down, 1, routing.valid_shape_m, routing.down_tuning)
        return down.view(T, K, H).sum(dim=1)

    def _probe_activation(self) -> str:
        """Which SiLU-and-mul ``experts`` runs: humming's fused kernel (``process_input``) when it compiles
        and matches torch on a small batch, else two torch kernels ("torch (<why>)")."""
        I = self.inter
        try:
            from humming.ops import process_input

            g = torch.randn(8, 2 * I, dtype=self.dtype, device=self.device)
            out = torch.empty(8, I, dtype=self.dtype, device=self.device)
            process_input(g, outputs=out, activation_type="binary_split", activation_impl=_SILU_MUL)
            ref = F.silu(g[:, :I].float()) * g[:, I:].float()
            torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
        except Exception as e:  # any failure falls back to torch, and says why
            return f"torch ({type(e).__name__}: {str(e)[:200]})"
        self._process_input = process_input
        return "humming"
