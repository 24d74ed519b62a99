"""What the planner does not model, said next to every plan so that nobody mistakes its silence."""

from __future__ import annotations

from moeserve.config import ModelConfig
from moeserve.planner.hardware import Hardware
from moeserve.planner.workload import DEFAULT_SETTINGS, EngineSettings


def not_modelled(cfg: ModelConfig, hw: Hardware, settings: EngineSettings = DEFAULT_SETTINGS) -> list[str]:
    notes = []
    if cfg.num_nextn_predict_layers and settings.speculative is None:
        notes.append(
            f"multi-token prediction: the checkpoint has {cfg.num_nextn_predict_layers} MTP layer(s); predictions are "
            'without speculative decoding (model it with --speculative-config \'{"method": "mtp", '
            '"num_speculative_tokens": 2}\' and --draft-acceptance-rate)'
        )
    if cfg.num_nextn_predict_layers and settings.speculative is None:
        notes.append("the MTP layer's weights are counted only with --speculative-config (the engine loads them only then)")
    if cfg.n_routed_experts and hw.gpus > 1:
        notes.append(
            "data-parallel attention (SGLang --enable-dp-attention, vLLM --data-parallel-size with expert "
            "parallelism) is not modelled: moeserve runs TP attention, so EP here keeps the all-reduces and the "
            "replicated MLA cache, and all-to-all dispatch is not counted"
        )
        notes.append(
            "kernel shape is measured for INT4 routed experts only (moeserve's kernels on one H200, shape.py): "
            "FP8 and bf16 experts stream at one efficiency whatever the slice; other engines' INT4 kernels are "
            "given our kernels' shape, not their level; routing is uniform (routing.py)"
        )
    if hw.gpus > 1:
        notes.append("decode context parallelism (vLLM --decode-context-parallel-size) is not modelled")
    notes.append(
        "the table is decode only: prefill and chunked-prefill stalls are counted by `moeserve sweep`'s "
        "prediction (planner/bench_prediction.py), not here"
    )
    return notes
