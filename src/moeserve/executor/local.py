"""Executors run steps on the model ranks. One rank: the runner lives in this process."""

from __future__ import annotations

import gc
import logging

import torch

from moeserve.config import ModelConfig
from moeserve.engine.config import EngineConfig, ResolvedSettings, resolve_settings
from moeserve.engine.model_runner import ModelRunner, PendingStep
from moeserve.engine.sampler import SampleResult
from moeserve.engine.step_input import StepInput
from moeserve.kernels.compile_watch import warn_of_compiles_after_ready

log = logging.getLogger("moeserve")


class LocalExecutor:
    def __init__(self, model_config: ModelConfig, config: EngineConfig):
        self.runner = ModelRunner(model_config, config)
        self.kv_capacity_pages = self.runner.num_pages
        self.page_size = self.runner.page_size
        self.settings: ResolvedSettings = resolve_settings(
            config, model_config.max_position_embeddings, pp=1, kv_capacity_tokens=self.kv_capacity_pages * self.page_size
        )
        self.runner.capture_graphs(self.settings.max_model_len)

    def submit(self, step: StepInput) -> PendingStep:
        return self.runner.launch(step)

    def wait(self, handle: PendingStep) -> SampleResult:
        return self.runner.collect(handle)

    def describe(self) -> list[str]:
        r = self.runner
        return [
            f"rank 0: layers [{r.stage.start_layer}, {r.stage.end_layer}), "
            f"weights {r.weight_bytes / 1e9:.3f} GB, KV {r.num_pages * r.page_size} tokens "
            f"({r.num_pages} pages of {r.page_size}), backend {r.backend.name}, "
            f"{r.dtype}, {r.device}"
        ]

    def watch_kernel_compiles(self) -> bool:
        return warn_of_compiles_after_ready(log)

    def shutdown(self) -> None:
        """Release the model and KV cache now, not whenever the engine object is collected."""
        if self.runner is None:
            return
        device = self.runner.device
        self.runner = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
