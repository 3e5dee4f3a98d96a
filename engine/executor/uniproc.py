"""One rank in this process: the `ModelRunner` itself, no Ray."""

import torch

from raylane.config import EngineConfig
from raylane.engine.executor.abstract import Executor
from raylane.engine.model_runner import ModelInput, ModelRunner
from raylane.engine.spec_decode.draft_model import draft_reservation_on


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig):
        self.runner = ModelRunner(config)
        draft = draft_reservation_on(self.runner)  # a draft model loads on this GPU after the cache
        self.runner.allocate_kv_cache(self.runner.available_kv_blocks(draft))
        self.num_blocks, self.block_size = self.runner.num_blocks, self.runner.block_size
        self.hf_config = self.runner.hf_config

    def execute_model(self, batch: ModelInput) -> torch.Tensor:
        return self.runner.execute_model(batch)

    def check_health(self) -> None:
        pass  # a failed step raises in the caller's thread; nothing else can die on its own

    def shutdown(self) -> None:
        pass
