"""Fit the hardware constants of the cost model to measured ``moeserve bench`` results.

A results file is one JSON object or a list of them (also accepted: an object with a
``results`` / ``runs`` list). Each needs a layout (``"layout": "tp8"`` or
``{"tp": 4, "pp": 2, "ep": 1}``, or top-level ``tp``/``pp``/``ep``), ``concurrency`` and
``output_throughput`` (tok/s) and/or ``mean_tpot_ms``; ``model``, ``hardware``,
``partition`` and the input/output lengths are used when present. Entries that cannot be
read are skipped with a warning, never fatal.

The fit: the measured decode cycle is ``mean_tpot_ms`` (else concurrency / output
throughput). A closed-loop serving run's mean TPOT (``moeserve bench --url`` results carry the
server's ``url``, vLLM's ``max_concurrency``; or say ``"closed_loop": true``) also holds the
prefills of each request's wave that fall in its decode window, so for those runs (with their
input and output lengths) the prediction adds them (``bench_prediction.wave_stall_ms``) instead of
taking the TPOT for the cycle. Entries that also carry ``prefill_tok_s`` (``moeserve bench --offline`` writes
it, with ``batch_size`` and ``input_len``) for at least ``MIN_PREFILL_TOKENS`` prompt tokens
add their prefill time, which is what pins the compute efficiency: decode alone is
bandwidth-bound and cannot. Residuals are
log(predicted / measured) times; the parameters are the
logs of the five constants relative to their priors, with a weak pull towards the priors
so that constants the data cannot see (e.g. FLOP/s when every run is bandwidth-bound) stay
where they were; efficiencies are capped at 1. Solved by damped Gauss-Newton (Levenberg-Marquardt)
in numpy. With two runs (batch 1 and 256) the fit cannot tell kernel latency floors from host
overhead (both are the same at every batch): the prior pull splits them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from moeserve.config import ModelConfig, load_model_config
from moeserve.distributed.layout import Layout
from moeserve.planner.bench_prediction import wave_stall_ms
from moeserve.planner.cost import decode_step
from moeserve.planner.hardware import FITTED_CONSTANTS, GPU_PRESETS, CostConstants, Hardware
from moeserve.planner.layout_names import parse_layout
from moeserve.planner.memory import resolve_partition

# A prefill shorter than one full default step (max_num_batched_tokens) is dominated by fixed
# costs (weight reads, launches) that the FLOP model has not got: it does not calibrate compute.
MIN_PREFILL_TOKENS = 8192
PRIOR_WEIGHT = 1e-3  # pull of each log-constant towards its prior, against squared log errors
MAX_LOG_STEP = 4.0  # constants stay within e^4 ~ 55x of their priors


@dataclass(frozen=True)
class Measurement:
    tp: int
    pp: int
    ep: int
    concurrency: int
    output_throughput: float | None
    mean_tpot_ms: float | None
    partition: tuple[int, ...] | None = None
    model: str | None = None
    hardware: str | None = None
    kv_len: float | None = None  # average cached tokens per sequence while decoding
    prefill_tok_s: float | None = None  # prompt tokens per second while prefilling ...
    prefill_seqs: int | None = None  # ... this many prompts ...
    input_len: int | None = None  # ... of this many tokens each
    output_len: int | None = None  # tokens generated per request
    # A closed-loop serving run (a server's URL in the result, or vLLM's max_concurrency): its mean
    # TPOT holds the prefills of each request's wave, where an offline decode run's does not.
    closed_loop: bool = False
    kv_dtype_bytes: int = 2  # the run's KV cache element size ("kv_cache_dtype": "fp8" -> 1)

    @property
    def has_prefill(self) -> bool:
        return bool(
            self.prefill_tok_s and self.prefill_seqs and self.input_len and self.prefill_seqs * self.input_len >= MIN_PREFILL_TOKENS
        )

    @property
    def prefill_s(self) -> float:
        assert self.has_prefill
        return self.prefill_seqs * self.input_len / self.prefill_tok_s

    @property
    def label(self) -> str:
        return Layout(self.tp, self.pp, self.ep).name

    @property
    def cycle_ms(self) -> float:
        if self.mean_tpot_ms:
            return self.mean_tpot_ms
        assert self.output_throughput
        return self.concurrency / self.output_throughput * 1e3

    @property
    def decode_tok_s(self) -> float:
        return self.concurrency / self.cycle_ms * 1e3


def _first(entry: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if entry.get(key) is not None:
            return entry[key]
    return None


def _hardware_name(value: Any) -> str | None:
    text = json.dumps(value).lower() if not isinstance(value, str) else value.lower()
    for name in sorted(GPU_PRESETS, key=len, reverse=True):
        if name in text or name.replace("-", " ") in text or name.replace("-", "") in text.replace(" ", ""):
            return name
    return None


def parse_measurement(entry: Any) -> Measurement:
    """One bench result; raises ValueError naming what is missing."""
    if not isinstance(entry, dict):
        raise ValueError(f"expected an object, got {type(entry).__name__}")
    layout = entry.get("layout")
    if layout is None and any(k in entry for k in ("tp", "pp", "ep")):
        layout = {k: entry[k] for k in ("tp", "pp", "ep") if k in entry}
    if layout is None:
        raise ValueError("no 'layout'")
    tp, pp, ep = parse_layout(layout)
    concurrency = _first(entry, "concurrency", "max_concurrency", "num_concurrent")
    if concurrency is None or int(concurrency) < 1:
        raise ValueError("no positive 'concurrency'")
    throughput = _first(entry, "output_throughput", "output_tok_s")
    tpot = _first(entry, "mean_tpot_ms", "tpot_ms")
    throughput = float(throughput) if throughput else None
    tpot = float(tpot) if tpot else None
    if not throughput and not tpot:
        raise ValueError("neither 'output_throughput' nor 'mean_tpot_ms' is a positive number")
    partition = _first(entry, "partition", "pp_layer_partition")
    if isinstance(partition, str):
        partition = [int(x) for x in partition.split(",")]
    in_len = _first(entry, "input_len", "random_input_len", "mean_input_tokens")
    out_len = _first(entry, "output_len", "random_output_len", "mean_output_tokens")
    kv_len = float(in_len) + float(out_len or 0) / 2 if in_len is not None else None
    prefill_tok_s = _first(entry, "prefill_tok_s")
    prefill_seqs = _first(entry, "batch_size", "num_prompts")
    hardware = entry.get("hardware")
    kv_dtype = str(_first(entry, "kv_cache_dtype", "kv_dtype") or "auto").lower()
    return Measurement(
        tp=tp,
        pp=pp,
        ep=ep,
        concurrency=int(concurrency),
        output_throughput=throughput,
        mean_tpot_ms=tpot,
        partition=tuple(partition) if partition else None,
        model=entry.get("model"),
        hardware=_hardware_name(hardware) if hardware is not None else None,
        kv_len=kv_len,
        prefill_tok_s=float(prefill_tok_s) if prefill_tok_s else None,
        prefill_seqs=int(prefill_seqs) if prefill_seqs else None,
        input_len=int(in_len) if in_len else None,
        output_len=int(out_len) if out_len else None,
        closed_loop=bool(entry.get("closed_loop", "url" in entry or "max_concurrency" in entry)),
        kv_dtype_bytes=1 if kv_dtype.startswith("fp8") else 2,
    )


def read_bench_results(path: str | Path) -> tuple[list[Measurement], list[str]]:
    """Measurements from a results file, and a warning for each entry skipped."""
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
    if isinstance(data, dict):
        for key in ("results", "runs", "benchmarks"):
            if isinstance(data.get(key), list):
                data = data[key]
                break
    entries = data if isinstance(data, list) else [data]
    measurements, warnings = [], []
    for i, entry in enumerate(entries):
        try:
            measurements.append(parse_measurement(entry))
        except (ValueError, TypeError) as e:
            warnings.append(f"{path}: entry {i} skipped: {e}")
    return measurements, warnings


def _error_pct(measured_s: float, predicted_s: float) -> float:
    """% error of the predicted rate (tok/s) given measured and predicted times."""
    return (measured_s / predicted_s - 1) * 100


@dataclass(frozen=True)
class CalibrationRow:
    measurement: Measurement
    before_ms: float
    after_ms: float

    @property
    def error_before(self) -> float:
        return _error_pct(self.measurement.cycle_ms, self.before_ms)

    @property
    def error_after(self) -> float:
        return _error_pct(self.measurement.cycle_ms, self.after_ms)


@dataclass(frozen=True)
class PrefillRow:
    measurement: Measurement
    before_s: float
    after_s: float

    def tok_s(self, seconds: float) -> float:
        m = self.measurement
        return m.prefill_seqs * m.input_len / seconds

    @property
    def error_before(self) -> float:
        return _error_pct(self.measurement.prefill_s, self.before_s)

    @property
    def error_after(self) -> float:
        return _error_pct(self.measurement.prefill_s, self.after_s)


@dataclass(frozen=True)
class Calibration:
    before: CostConstants
    after: CostConstants
    rows: tuple[CalibrationRow, ...]
    warnings: tuple[str, ...] = ()
    prefill_rows: tuple[PrefillRow, ...] = ()
    holdout: tuple[CalibrationRow, ...] = ()  # runs predicted after the fit, not used by it

    @staticmethod
    def _rms(errors: list[float]) -> float:
        return math.sqrt(sum(e * e for e in errors) / len(errors)) if errors else 0.0

    @property
    def rms_error_before(self) -> float:
        return self._rms([r.error_before for r in self.rows])

    @property
    def rms_error_after(self) -> float:
        return self._rms([r.error_after for r in self.rows])

    @property
    def holdout_rms_error(self) -> float:
        return self._rms([r.error_after for r in self.holdout])


def predict_cycle_ms(cfg: ModelConfig, hw: Hardware, m: Measurement, default_kv_len: float) -> float:
    """What ``m.cycle_ms`` measured: the decode cycle, plus the wave's prefills for a closed-loop run."""
    partition = resolve_partition(cfg, m.pp, list(m.partition) if m.partition else None)
    kv_len = m.kv_len if m.kv_len is not None else default_kv_len
    batch = min(m.concurrency, m.prefill_seqs or m.concurrency)
    cycle = decode_step(cfg, hw, m.tp, m.pp, m.ep, partition, batch, kv_len, m.kv_dtype_bytes).cycle_ms
    if m.closed_loop and m.mean_tpot_ms and m.input_len and m.output_len:
        cycle += wave_stall_ms(cfg, hw, m.tp * m.pp, batch, m.input_len, m.output_len)
    return cycle


def predict_prefill_s(cfg: ModelConfig, hw: Hardware, m: Measurement) -> float:
    """Prompt FLOPs over the compute of all the layout's GPUs (as ``planner.bench_prediction`` predicts)."""
    from moeserve.planner.bounds import prefill_flops

    return prefill_flops(cfg, m.prefill_seqs, m.input_len) / (m.tp * m.pp * hw.flops_per_s)


def _constants(prior: CostConstants, theta: np.ndarray) -> CostConstants:
    """The constants at log-offsets ``theta`` from the prior; efficiencies stay at or below 1 (no kernel beats
    the datasheet)."""
    values = {k: getattr(prior, k) * math.exp(t) for k, t in zip(FITTED_CONSTANTS, theta)}
    return replace(prior, **{k: min(v, 1.0) if k.endswith("_efficiency") else v for k, v in values.items()})


def fit_constants(
    items: list[tuple[ModelConfig, Measurement]], hw: Hardware, default_kv_len: float, prior_weight: float = PRIOR_WEIGHT
) -> Calibration:
    """Least-squares fit of ``hw.constants`` to measured decode cycles of (model config, measurement) pairs."""
    if not items:
        raise ValueError("no usable measurements to calibrate on")
    prior = hw.constants
    prefills = [(cfg, m) for cfg, m in items if m.has_prefill]
    measured = np.log([m.cycle_ms for _, m in items] + [m.prefill_s for _, m in prefills])

    def predict(theta: np.ndarray) -> np.ndarray:
        h = hw.with_constants(_constants(prior, theta))
        return np.log(
            [predict_cycle_ms(cfg, h, m, default_kv_len) for cfg, m in items] + [predict_prefill_s(cfg, h, m) for cfg, m in prefills]
        )

    def residuals(theta: np.ndarray) -> np.ndarray:
        return np.concatenate([predict(theta) - measured, math.sqrt(prior_weight) * theta])

    theta = np.zeros(len(FITTED_CONSTANTS))
    r = residuals(theta)
    cost, damping = float(r @ r), 1e-3
    for _ in range(100):
        step = 1e-4
        jac = np.stack([(residuals(theta + step * e) - r) / step for e in np.eye(len(theta))], axis=1)
        jtj, jtr = jac.T @ jac, jac.T @ r
        improved = False
        while damping < 1e8:
            delta = np.linalg.solve(jtj + damping * np.diag(np.diag(jtj) + 1e-12), -jtr)
            cand = np.clip(theta + delta, -MAX_LOG_STEP, MAX_LOG_STEP)
            r_cand = residuals(cand)
            c = float(r_cand @ r_cand)
            if c < cost:
                improved = cost - c > 1e-12 * max(cost, 1e-30)
                theta, r, cost, damping = cand, r_cand, c, max(damping / 10, 1e-9)
                break
            damping *= 10
        if not improved:
            break
    after = _constants(prior, theta)
    before, after_t = np.exp(predict(np.zeros_like(theta))), np.exp(predict(theta))
    n = len(items)
    rows = tuple(CalibrationRow(m, float(b), float(a)) for (_, m), b, a in zip(items, before[:n], after_t[:n]))
    prefill_rows = tuple(PrefillRow(m, float(b), float(a)) for (_, m), b, a in zip(prefills, before[n:], after_t[n:]))
    return Calibration(prior, after, rows, prefill_rows=prefill_rows)


def _config_for(model: str, fallback: ModelConfig, fallback_name: str, warnings: list[str]) -> ModelConfig:
    """The config of a measured model: a local dir, a built-in name, or a built-in matching its basename."""
    for candidate in (model, Path(model).name.lower()):
        try:
            return load_model_config(candidate)
        except (FileNotFoundError, ValueError, OSError):
            continue
    warnings.append(f"model {model!r} not found here; predicting its runs as {fallback_name}")
    return fallback


def load_measurements(
    paths: list[str], hw: Hardware, fallback_cfg: ModelConfig, fallback_name: str
) -> tuple[list[tuple[ModelConfig, Measurement]], list[str]]:
    """Every usable run of the files, paired with its model's config; runs on other GPUs are skipped."""
    warnings: list[str] = []
    items: list[tuple[ModelConfig, Measurement]] = []
    configs: dict[str, ModelConfig] = {}
    for path in paths:
        measurements, skipped = read_bench_results(path)
        warnings += skipped
        for m in measurements:
            if m.hardware is not None and m.hardware != hw.gpu:
                warnings.append(f"{path}: {m.label} at {m.concurrency} was measured on {m.hardware}, not {hw.gpu}: skipped")
                continue
            if m.tp * m.pp != hw.gpus:
                warnings.append(f"{path}: note: {m.label} uses {m.tp * m.pp} GPUs (plan is for {hw.gpus}); used as is")
            cfg = fallback_cfg
            if m.model and m.model != fallback_name:
                if m.model not in configs:
                    configs[m.model] = _config_for(m.model, fallback_cfg, fallback_name, warnings)
                cfg = configs[m.model]
            items.append((cfg, m))
    return items, warnings


def calibrate_from_files(
    paths: list[str],
    hw: Hardware,
    fallback_cfg: ModelConfig,
    fallback_name: str,
    default_kv_len: float,
    holdout: list[str] | None = None,
) -> Calibration:
    """Read every file, pair each measurement with its model's config, fit. Skips runs on other GPUs.

    ``holdout`` files are predicted with the fitted constants but not fitted to: their errors
    (``Calibration.holdout``) say how well the calibrated model predicts runs it has not seen."""
    items, warnings = load_measurements(paths, hw, fallback_cfg, fallback_name)
    if not items:
        raise ValueError("no usable measurements to calibrate on: " + ("; ".join(warnings) or "the files are empty"))
    cal = fit_constants(items, hw, default_kv_len)
    held: tuple[CalibrationRow, ...] = ()
    if holdout:
        test, more = load_measurements(holdout, hw, fallback_cfg, fallback_name)
        warnings += more
        held = holdout_rows(test, hw, cal.after, default_kv_len)
    return replace(cal, warnings=tuple(warnings), holdout=held)


def holdout_rows(
    items: list[tuple[ModelConfig, Measurement]], hw: Hardware, fitted: CostConstants, default_kv_len: float
) -> tuple[CalibrationRow, ...]:
    """Runs predicted with the priors (before) and with ``fitted`` constants (after), not fitted to."""
    after = hw.with_constants(fitted)
    return tuple(
        CalibrationRow(m, predict_cycle_ms(cfg, hw, m, default_kv_len), predict_cycle_ms(cfg, after, m, default_kv_len)) for cfg, m in items
    )
