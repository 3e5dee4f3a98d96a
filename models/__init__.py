"""Model definitions on the parallel layers, and Hugging Face checkpoint loading.

The engine needs only `load_model`; see `DecoderForCausalLM` for the model interface. The names load
on first use (PEP 562), so a serving process that needs only `raylane.models.gguf` (the tokenizer's
checkpoint lookup) does not import the model code and transformers' model utilities with it.
"""

import importlib

_EXPORTS = {
    "Attention": "raylane.models.attention",
    "AttentionMetadata": "raylane.models.attention",
    "build_attention_metadata": "raylane.models.attention",
    "DecoderForCausalLM": "raylane.models.decoder",
    "MissingWeightError": "raylane.models.loader",
    "load_model": "raylane.models.loader",
    "MODEL_REGISTRY": "raylane.models.registry",
    "UnsupportedModelError": "raylane.models.registry",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'models' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
