"""What `LLMEngine` asks of the ranks, wherever they run."""

from abc import ABC, abstractmethod

import torch

from raylane.engine.model_runner import ModelInput


class Executor(ABC):
    num_blocks: int  # KV blocks every rank holds
    block_size: int  # tokens per KV block, as the ranks chose it on their device
    draft_device: torch.device | None = None  # where a draft model in this process runs (None: its config's)
    hf_config: object

    @abstractmethod
    def execute_model(self, batch: ModelInput) -> torch.Tensor:
        """Run one step on every rank; float32 logits [len(batch.sample_indices), vocab] on CPU."""

    @abstractmethod
    def check_health(self) -> None:
        """Raise `EngineDeadError` if the ranks can no longer run steps."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release the ranks and their resources."""
