"""Which model class serves which Hugging Face architecture."""

from transformers import PreTrainedConfig

from raylane.models.decoder import (
    DecoderForCausalLM,
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from raylane.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[DecoderForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


class UnsupportedModelError(ValueError):
    """The checkpoint's `architectures[0]` has no model class here."""


def get_model_class(config: PreTrainedConfig) -> type[DecoderForCausalLM]:
    architectures = getattr(config, "architectures", None) or []
    arch = architectures[0] if architectures else None
    if arch not in MODEL_REGISTRY:
        raise UnsupportedModelError(
            f"unsupported model architecture {arch!r}; supported: {', '.join(MODEL_REGISTRY)}"
        )
    return MODEL_REGISTRY[arch]
