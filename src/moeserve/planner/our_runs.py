"""Our own measured runs (BENCHMARKS.md), as data: what calibration is held out against.

One H200, Moonlight-16B-A3B shape, bf16, dummy weights, ``tp1``, 1024 prompt tokens. Each
session is one commit; the figures are copied from the files named in ``Session.source``
(``tests/planner/test_planner_fidelity.py`` reads those files and checks the copies).

``held_out(session)`` calibrates on two runs (batch 1 and 256: the extremes) and predicts the
others with the fitted constants.
"""

from __future__ import annotations

from dataclasses import dataclass

from moeserve.config import load_model_config
from moeserve.planner.calibrate import CalibrationRow, Measurement, fit_constants, holdout_rows
from moeserve.planner.hardware import resolve_hardware

MODEL = "moonlight-16b-a3b"


@dataclass(frozen=True)
class Session:
    name: str
    commit: str
    source: str  # the file the figures are copied from, relative to the repository root
    output_len: int
    decode_tok_s: tuple[tuple[int, float], ...]  # (batch, decode tok/s)
    note: str = ""

    def measurements(self) -> dict[int, Measurement]:
        kv_len = 1024 + self.output_len / 2
        return {b: Measurement(1, 1, 1, b, tok_s, None, kv_len=kv_len, model=MODEL, hardware="h200") for b, tok_s in self.decode_tok_s}


SESSIONS: tuple[Session, ...] = (
    Session(
        "third session",
        "a39fd70",
        "benchmarks/h200-2026-11-29c/run4_bench_bf16.log",
        256,
        ((1, 382.9), (8, 1004.7), (64, 4540.1), (256, 14218.4)),
        "the kernels the planner's moeserve profile describes (fused MoE GEMV, 12 kernels a layer)",
    ),
    Session(
        "second session",
        "58e0b2a",
        "benchmarks/h200-2026-11-29b/gpu_check_bf16.json",
        256,
        ((1, 292.1), (8, 959.4), (64, 4865.8), (256, 14704.0)),
        "before the shared experts moved into the MoE GEMV: more kernels at batch 1 than the profile has",
    ),
    Session(
        "first session",
        "fd99480",
        "benchmarks/h200-2026-11-29/calibrate_input.json",
        128,
        ((1, 110.3), (64, 3210.0), (256, 8172.0)),
        "synchronous host (~5 ms a step) and a 15-kernel MoE alignment at every batch",
    ),
    Session(
        "eighth session",
        "4cf3f00",
        "benchmarks/h200-2026-12-01e/runs_4cf3f00/offline.log",
        128,
        ((1, 403.1), (128, 10700.2), (256, 17592.1)),
        "the newest offline rates: decode graphs at every batch, tuned MoE tiles",
    ),
)

FIT_BATCHES = (1, 256)


@dataclass(frozen=True)
class HeldOut:
    session: Session
    fitted: tuple[CalibrationRow, ...]
    held_out: tuple[CalibrationRow, ...]


def held_out(session: Session, fit_batches: tuple[int, ...] = FIT_BATCHES) -> HeldOut:
    cfg = load_model_config(MODEL)
    hw = resolve_hardware(1, gpu="h200")
    runs = session.measurements()
    fit = [(cfg, runs[b]) for b in fit_batches]
    test = [(cfg, m) for b, m in runs.items() if b not in fit_batches]
    cal = fit_constants(fit, hw, 1024 + session.output_len / 2)
    return HeldOut(session, cal.rows, holdout_rows(test, hw, cal.after, 1024 + session.output_len / 2))
