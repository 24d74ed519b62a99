"""``moeserve bench --offline``: prefill and decode throughput of the engine itself, each
figure beside its bound (bytes / measured bandwidth, FLOPs / measured peak)."""

from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from moeserve.planner.bounds import DevicePeaks, decode_step_cost, measure_peaks, prefill_flops
from moeserve.engine.config import resolve_device, resolve_dtype
from moeserve.llm import LLM
from moeserve.sampling_params import SamplingParams

log = logging.getLogger("moeserve")


@dataclass
class OfflineResult:
    batch_size: int
    input_len: int
    output_len: int
    prefill_s: float
    prefill_tok_s: float
    prefill_bound_tok_s: float  # FLOPs / peak
    prefill_frac_of_peak: float
    decode_s: float
    decode_tok_s: float
    decode_bound_tok_s: float  # min over bytes/bandwidth and FLOPs/peak
    decode_frac_of_bound: float
    step_ms: float
    # speculative decoding: tokens a decode row gained a step in this batch's decode (None without it)
    accepted_length: float | None = None


def _sync(llm: LLM) -> None:
    if llm.config.device.startswith("cuda"):
        torch.cuda.synchronize()


def run_batch(
    llm: LLM,
    batch: int,
    input_len: int,
    output_len: int,
    peaks: DevicePeaks,
    seed: int = 0,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = -1,
) -> OfflineResult:
    eng = llm.engine
    cfg = eng.model_config
    g = torch.Generator().manual_seed(seed + batch)
    prompts = torch.randint(0, cfg.vocab_size, (batch, input_len), generator=g).tolist()
    # Untimed warm-up at the timed prefill's chunk shape (first-use Triton compiles land here), on
    # prompts of its own: the timed ones must not find their pages in the prefix cache.
    per_step = max(1, min(batch, llm.config.max_num_batched_tokens // input_len))
    warm = torch.randint(0, cfg.vocab_size, (per_step, input_len), generator=g).tolist()
    llm.generate([{"prompt_token_ids": p} for p in warm], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    # ... and at the timed decode's batch, for several steps: a speculative step's kernels (the
    # verify's k + 1 tokens a row, the drafter's passes) first run from the second decode step. With
    # only the warm-up above, a V3 MTP step measured 11.15 ms here against 6.43 ms after 12 warm
    # steps (scripts/profile/spec_profile.py, H100, 2026-12-06).
    short = torch.randint(0, cfg.vocab_size, (batch, 16), generator=g).tolist()
    llm.generate([{"prompt_token_ids": p} for p in short], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=output_len, ignore_eos=True, seed=seed if temperature else None
    )
    for p in prompts:
        eng.add_request({"prompt_token_ids": p}, params)
    seqs = list(eng.scheduler.waiting)
    _sync(llm)
    t0 = time.perf_counter()
    while any(s.num_output_tokens < 1 for s in seqs):
        eng.step(finished_only=True)
    _sync(llm)
    t1 = time.perf_counter()
    steps = 0
    drafts0, accepted0 = eng.spec_num_drafts, eng.spec_num_accepted_tokens
    while eng.has_unfinished_requests():
        eng.step(finished_only=True)
        steps += 1
    _sync(llm)
    t2 = time.perf_counter()
    drafts = eng.spec_num_drafts - drafts0
    accepted_length = 1 + (eng.spec_num_accepted_tokens - accepted0) / drafts if drafts else None
    dtype = resolve_dtype(llm.config.dtype, cfg.torch_dtype, torch.device(llm.config.device).type)
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    prefill_s, decode_s = t1 - t0, t2 - t1
    decode_tokens = batch * (output_len - 1)
    ctx = input_len + output_len // 2
    cost = decode_step_cost(cfg, batch, ctx, dtype_bytes)
    step_bound_s = max(cost.bytes / peaks.bandwidth, cost.flops / peaks.flops)
    decode_bound = batch / step_bound_s
    pf = prefill_flops(cfg, batch, input_len)
    prefill_tok_s = batch * input_len / prefill_s
    decode_tok_s = decode_tokens / decode_s if decode_s > 0 else float("nan")
    return OfflineResult(
        batch_size=batch,
        input_len=input_len,
        output_len=output_len,
        prefill_s=prefill_s,
        prefill_tok_s=prefill_tok_s,
        prefill_bound_tok_s=batch * input_len / (pf / peaks.flops),
        prefill_frac_of_peak=(pf / prefill_s) / peaks.flops,
        decode_s=decode_s,
        decode_tok_s=decode_tok_s,
        decode_bound_tok_s=decode_bound,
        decode_frac_of_bound=decode_tok_s / decode_bound,
        step_ms=1000 * decode_s / max(steps, 1),
        accepted_length=accepted_length,
    )


@functools.cache
def _peaks(device: str) -> DevicePeaks:
    """The device's copy bandwidth and matmul peak, measured once a process (a sweep runs several engines)."""
    peaks = measure_peaks(device)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # the copy's buffers back to the device before an engine sizes its KV cache
    return peaks


def run_offline(
    model: str,
    batch_sizes: list[int],
    input_len: int,
    output_len: int,
    result_dir: str | None,
    engine_kwargs: dict,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = -1,
) -> list[OfflineResult]:
    from moeserve.console import wide_console
    from rich.table import Table

    max_batch = max(batch_sizes)
    kwargs = dict(engine_kwargs)
    kwargs.setdefault("max_num_seqs", max_batch)
    kwargs["max_model_len"] = kwargs.get("max_model_len") or input_len + output_len + 16
    # Before the engine loads: its KV cache then takes the memory the copy would need.
    peaks = _peaks(resolve_device(kwargs.get("device") or "auto"))
    with LLM(model, **kwargs) as llm:
        # Warm-up: one short request through everything (kernels compiled, graphs captured).
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        results = [run_batch(llm, b, input_len, output_len, peaks, temperature=temperature, top_p=top_p, top_k=top_k) for b in batch_sizes]
        layout = list(llm.engine.executor.describe())
        layout_name = getattr(getattr(llm.engine.executor, "layout", None), "name", "tp1")
    table = Table(
        title=f"moeserve offline: {llm.config.model} ({peaks.device}; measured copy "
        f"{peaks.bandwidth / 1e12:.2f} TB/s, matmul {peaks.flops / 1e12:.1f} TFLOP/s)"
    )
    for col in ("batch", "prefill tok/s", "bound (FLOPs)", "% peak", "decode tok/s", "bound", "% bound", "ms/step"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(
            str(r.batch_size),
            f"{r.prefill_tok_s:,.0f}",
            f"{r.prefill_bound_tok_s:,.0f}",
            f"{100 * r.prefill_frac_of_peak:.1f}",
            f"{r.decode_tok_s:,.1f}",
            f"{r.decode_bound_tok_s:,.0f}",
            f"{100 * r.decode_frac_of_bound:.1f}",
            f"{r.step_ms:.2f}",
        )
    wide_console().print(table)
    spec = _speculation(llm)
    if spec:
        wide_console().print(
            f"speculative decoding ({spec['method'].upper()}, k={spec['num_speculative_tokens']}): {spec['num_accepted_tokens']:,} of "
            f"{spec['num_draft_tokens']:,} drafts accepted ({100 * spec['acceptance_rate']:.1f} %), mean accepted length "
            f"{spec['mean_accepted_length']:.2f} tokens a step (warm-ups included)"
        )
    if result_dir:
        out = Path(result_dir)
        out.mkdir(parents=True, exist_ok=True)
        doc = {
            "model": llm.config.model,
            "device": peaks.device,
            "peaks": asdict(peaks),
            "layout": layout,
            "engine": {k: v for k, v in kwargs.items() if isinstance(v, (int, float, str, type(None)))},
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "speculative": spec,
            # Each row also carries the keys `moeserve plan --calibrate` reads.
            "results": [
                {
                    **asdict(r),
                    "layout": layout_name,
                    "concurrency": r.batch_size,
                    "output_throughput": r.decode_tok_s,
                    "mean_tpot_ms": r.step_ms,
                    "model": str(model),
                    "hardware": peaks.device,
                }
                for r in results
            ],
        }
        (out / "offline.json").write_text(json.dumps(doc, indent=2))
    return results


def run_speculation_sweep(
    model: str,
    ks: list[int],
    batch_sizes: list[int],
    input_len: int,
    output_len: int,
    result_dir: str | None,
    engine_kwargs: dict,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = -1,
) -> dict[int, list[OfflineResult]]:
    """``run_offline`` once per number of draft tokens in ``ks`` (0: without speculation), the
    method and draft of ``engine_kwargs["speculative_config"]``; then one table: decode tok/s,
    tokens a row gains a step, and the speed-up over k = 0 where it ran."""
    from moeserve.console import wide_console
    from rich.table import Table

    spec = engine_kwargs.get("speculative_config")
    if not spec:
        raise ValueError("--num-speculative-tokens sweeps a --speculative-config: give one (its num_speculative_tokens is replaced)")
    if not ks or any(k < 0 for k in ks):
        raise ValueError(f"--num-speculative-tokens: non-negative integers, got {ks}")
    runs: dict[int, list[OfflineResult]] = {}
    for k in ks:
        kwargs = dict(engine_kwargs, speculative_config={**spec, "num_speculative_tokens": k} if k else None)
        out = str(Path(result_dir) / f"k{k}") if result_dir else None
        runs[k] = run_offline(model, batch_sizes, input_len, output_len, out, kwargs, temperature, top_p, top_k)
    table = Table(title=f"speculative decoding ({spec.get('method', 'mtp')}) by draft tokens k: decode tok/s (tokens a row gains a step)")
    table.add_column("k", justify="right")
    for b in batch_sizes:
        table.add_column(f"batch {b}", justify="right")
    base = runs.get(0)
    for k, results in runs.items():
        cells = []
        for j, r in enumerate(results):
            cell = f"{r.decode_tok_s:,.1f}"
            if r.accepted_length is not None:
                cell += f" ({r.accepted_length:.2f})"
            if base is not None and k:
                cell += f" x{r.decode_tok_s / base[j].decode_tok_s:.2f}"
            cells.append(cell)
        table.add_row(str(k), *cells)
    wide_console().print(table)
    if result_dir:
        summary = {
            str(k): [{"batch_size": r.batch_size, "decode_tok_s": r.decode_tok_s, "accepted_length": r.accepted_length} for r in results]
            for k, results in runs.items()
        }
        (Path(result_dir) / "speculation_sweep.json").write_text(json.dumps({"speculative_config": spec, "runs": summary}, indent=2))
    return runs


def _speculation(llm: LLM) -> dict | None:
    """The engine's speculative-decoding counts (None without speculation)."""
    e = llm.engine
    if e.speculative is None:
        return None
    return {
        "method": e.speculative.method,
        "num_speculative_tokens": e.speculative.num_speculative_tokens,
        "num_drafts": e.spec_num_drafts,
        "num_draft_tokens": e.spec_num_draft_tokens,
        "num_accepted_tokens": e.spec_num_accepted_tokens,
        "acceptance_rate": e.spec_num_accepted_tokens / max(1, e.spec_num_draft_tokens),
        "mean_accepted_length": e.spec_mean_accepted_length,
    }
