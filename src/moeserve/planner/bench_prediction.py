"""What a closed-loop serving benchmark should measure on a layout, by the planner's cost model.

``moeserve bench`` sends ``num_prompts`` requests, ``concurrency`` at a time, each with
``input_len`` prompt tokens and exactly ``output_len`` output tokens. Its output throughput is
not the decode rate alone: every prompt is prefilled too, and at high concurrency with few
prompts that is most of the run. Here:

* prefill: the model FLOPs of all prompts (matmuls + causal attention) at the layout's
  compute rate (every GPU busy: TP splits each matmul, PP stages work on different chunks);
* decode: ``ceil(N / C)`` waves of ``output_len - 1`` decode cycles at batch ``min(C, N)`` with
  the average cache of ``input_len + output_len / 2`` tokens (the first token comes from the
  prefill);
* output tok/s = all output tokens / (prefill + decode time);
* mean TPOT: the decode cycle plus the prefills inside a request's decode window. The requests
  start together and all end after ``output_len`` tokens, so they run in waves of the batch:
  each gets its first token once its own prompt is prefilled, and the prompts of its wave
  prefilled after it (on average ``(batch - 1) / 2``) fall inside its ``output_len - 1`` steps,
  whatever the order of prefill and decode within the wave. (On one H200, Moonlight shape, 1024
  in / 128 out at concurrency 128: 17.4-18.0 ms measured; the decode cycle alone 11.9 ms.)

Tensor-parallel all-reduces during prefill are not counted (they overlap poorly, so this
errs fast for TP layouts on slow links).

``serving_tpot_ms`` predicts a serving benchmark's mean TPOT instead: in a closed loop of
``concurrency`` requests of ``output_len`` tokens, ``concurrency / output_len`` requests finish
every decode step and as many new ones are prefilled, in the same steps (chunked prefill), so
every step carries their prompt FLOPs on top of the decode cycle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moeserve.planner.bounds import prefill_attention_flops, prefill_flops
from moeserve.config import ModelConfig
from moeserve.planner.cost import decode_step
from moeserve.planner.hardware import Hardware
from moeserve.distributed.layout import Layout
from moeserve.planner.memory import resolve_partition


@dataclass(frozen=True)
class BenchPrediction:
    output_throughput: float  # tok/s over the whole run
    mean_tpot_ms: float  # the decode cycle plus the wave's prefills inside a request's window
    prefill_s: float
    decode_s: float
    decode_cycle_ms: float  # one decode cycle at the run's batch


def prefill_time_s(cfg: ModelConfig, hw: Hardware, world: int, num_prompts: int, input_len: int) -> float:
    """Prompt FLOPs over the layout's compute: matmuls at the FP8 rate for FP8 weights, attention at bf16."""
    attention = prefill_attention_flops(cfg, num_prompts, input_len)
    linear = prefill_flops(cfg, num_prompts, input_len) - attention
    fp8 = cfg.quantization is not None and cfg.quantization.block_size is not None
    return linear / (world * hw.matmul_flops_per_s(fp8)) + attention / (world * hw.flops_per_s)


def wave_stall_ms(cfg: ModelConfig, hw: Hardware, world: int, batch: int, input_len: int, output_len: int) -> float:
    """What a closed-loop benchmark's mean TPOT holds beyond the decode cycle: the prompts of a
    request's wave prefilled inside its decode window, on average ``(batch - 1) / 2``, spread
    over its ``output_len - 1`` steps."""
    if output_len < 2 or batch < 2 or input_len < 1:
        return 0.0
    return (batch - 1) / 2 * prefill_time_s(cfg, hw, world, 1, input_len) * 1e3 / (output_len - 1)


def serving_tpot_ms(
    cfg: ModelConfig, hw: Hardware, layout: Layout, concurrency: int, input_len: int, output_len: int, kv_dtype_bytes: int = 2
) -> float:
    """Mean TPOT of a closed-loop serving benchmark: the decode cycle plus the prefills that join it."""
    partition = resolve_partition(cfg, layout.pp, list(layout.partition) if layout.partition else None)
    cycle = decode_step(
        cfg, hw, layout.tp, layout.pp, layout.ep, partition, concurrency, input_len + output_len / 2, kv_dtype_bytes
    ).cycle_ms
    joins = concurrency / output_len if input_len else 0.0  # new requests per decode step
    return cycle + joins * prefill_time_s(cfg, hw, layout.world_size, 1, input_len) * 1e3


def predict_bench(
    cfg: ModelConfig, hw: Hardware, layout: Layout, concurrency: int, num_prompts: int, input_len: int, output_len: int
) -> BenchPrediction:
    if min(concurrency, num_prompts, input_len, output_len) < 1:
        raise ValueError("concurrency, num_prompts, input_len and output_len must be positive")
    prefill = prefill_time_s(cfg, hw, layout.world_size, num_prompts, input_len)
    batch = min(concurrency, num_prompts)
    partition = resolve_partition(cfg, layout.pp, list(layout.partition) if layout.partition else None)
    cycle = decode_step(cfg, hw, layout.tp, layout.pp, layout.ep, partition, batch, input_len + output_len / 2)
    decode_s = math.ceil(num_prompts / concurrency) * (output_len - 1) * cycle.cycle_ms / 1e3
    stall_ms = wave_stall_ms(cfg, hw, layout.world_size, batch, input_len, output_len)
    return BenchPrediction(num_prompts * output_len / (prefill + decode_s), cycle.cycle_ms + stall_ms, prefill, decode_s, cycle.cycle_ms)
