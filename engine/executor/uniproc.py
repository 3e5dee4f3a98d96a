"""One rank in this process: the `ModelRunner` itself, no Ray."""

import torch

from cluster.config import EngineConfig
from engine.executor.abstract import Executor
from engine.model_runner import ModelInput, ModelRunner


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig):
        self.runner = ModelRunner(config)
        draft = None
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model" and self.runner.device.type == "cuda":
            from engine.spec_decode.draft_model import draft_reservation

            draft = draft_reservation(config, self.runner.dtype)  # it loads on this GPU after the cache
        self.runner.allocate_kv_cache(self.runner.available_kv_blocks(draft))
        self.num_blocks = self.runner.num_blocks
        self.hf_config = self.runner.hf_config

    def execute_model(self, batch: ModelInput) -> torch.Tensor:
        return self.runner.execute_model(batch)

    def check_health(self) -> None:
        pass  # a failed step raises in the caller's thread; nothing else can die on its own

    def shutdown(self) -> None:
        pass
