"""What the layers do with their weights once loaded: the settings and shared state of one model's pass.

vLLM's pattern: the loader copies checkpoint tensors into the parameters, then calls each layer's
`process_weights_after_loading()`, and the layer turns its weight into the form it computes with
(quantized, or prepacked for oneDNN). One `WeightProcessing` goes to every layer of a model, because
two decisions need the whole model: which weights are tied (an embedding and the LM head share one
tensor, which must be quantized once and not freed while the other still reads it) and the one
warning that lists every layer int4 could not take.
"""

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from raylane.parallel.int4 import GROUP_SIZE

QUANTIZATION_METHODS = ("int8", "int4")
# What `quantization="int4"` does with the embedding and the LM head (tied in most small models):
# "int8", "int4", or None (they stay in the model dtype).
INT4_VOCAB_METHOD: str | None = "int8"
logger = logging.getLogger(__name__)


@dataclass(slots=True)
class WeightProcessing:
    """Settings of the pass (`quantization`, `prepack`) and what the layers share during it."""

    quantization: str | None = None
    # Replace fp weights by oneDNN's packed layout (CPU, and only where `onednn.available(dtype)`).
    prepack: bool = False
    # Keep a oneDNN-packed dense copy of every quantized weight a layer multiplies by, for batched calls.
    batch_copy: bool = False
    # ids of parameters that more than one module holds (a tied embedding and LM head).
    tied: frozenset[int] = frozenset()
    # (id(weight), method) -> the quantized form, so a tied weight is quantized once.
    shared: dict = field(default_factory=dict)
    # Shapes of layers that asked for int4 but got int8 (their shard is not a whole number of groups).
    int8_fallbacks: list[tuple[int, ...]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.quantization not in (None, *QUANTIZATION_METHODS):
            raise ValueError(
                f"quantization: {self.quantization!r} is not supported; supported: {QUANTIZATION_METHODS}"
            )

    @classmethod
    def for_model(
        cls, model: nn.Module, quantization: str | None, prepack: bool, batch_copy: bool = False
    ) -> "WeightProcessing":
        holders: dict[int, int] = {}
        for module in model.modules():
            for param in module.parameters(recurse=False):
                holders[id(param)] = holders.get(id(param), 0) + 1
        tied = frozenset(pid for pid, count in holders.items() if count > 1)
        return cls(quantization=quantization, prepack=prepack, tied=tied, batch_copy=batch_copy)

    def vocab_method(self) -> str | None:
        """The quantization of the embedding and the LM head."""
        return INT4_VOCAB_METHOD if self.quantization == "int4" else self.quantization

    def keeps_dense(self, weight: torch.Tensor) -> bool:
        """Whether a packed layer must keep its dense weight: another module still reads it."""
        return id(weight) in self.tied

    def report(self) -> None:
        """Log once, after every layer ran, what did not go as asked."""
        if self.int8_fallbacks:
            logger.warning(
                "int4: %d layers whose shard is not a multiple of %d inputs (or 16 outputs) wide "
                "took int8: %s",
                len(self.int8_fallbacks),
                GROUP_SIZE,
                sorted(set(self.int8_fallbacks)),
            )
