"""Executors run steps on the model ranks. One rank: the runner lives in this process."""

from __future__ import annotations

import gc

import torch

from moeserve.config import ModelConfig
from moeserve.engine.config import EngineConfig, resolve_max_model_len, uses_async_scheduling
from moeserve.engine.model_runner import ModelRunner, PendingStep
from moeserve.engine.sampler import SampleResult
from moeserve.engine.step_input import StepInput


class LocalExecutor:
    def __init__(self, model_config: ModelConfig, config: EngineConfig):
        self.runner = ModelRunner(model_config, config)
        self.kv_capacity_pages = self.runner.num_pages
        self.runner.capture_graphs(resolve_max_model_len(config.max_model_len, model_config.max_position_embeddings,
                                                         self.kv_capacity_pages * self.runner.page_size))
        self.page_size = self.runner.page_size
        # Asynchronous scheduling: the engine schedules step n+1 while step n runs on the device.
        self.overlap = uses_async_scheduling(config, pp=1)
        self.max_in_flight = 2 if self.overlap else 1

    def submit(self, step: StepInput) -> PendingStep:
        return self.runner.launch(step)

    def wait(self, handle: PendingStep) -> SampleResult:
        return self.runner.collect(handle)

    def describe(self) -> list[str]:
        r = self.runner
        return [f"rank 0: layers [{r.stage.start_layer}, {r.stage.end_layer}), "
                f"weights {r.weight_bytes / 1e9:.3f} GB, KV {r.num_pages * r.page_size} tokens "
                f"({r.num_pages} pages of {r.page_size}), backend {r.backend.name}, "
                f"{r.dtype}, {r.device}"]

    def shutdown(self) -> None:
        """Release the model and KV cache now, not whenever the engine object is collected."""
        if self.runner is None:
            return
        device = self.runner.device
        self.runner = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
