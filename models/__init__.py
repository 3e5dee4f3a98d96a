"""Model definitions on the parallel layers, and Hugging Face checkpoint loading.

The engine needs only `load_model`; see `DecoderForCausalLM` for the model interface.
"""

from models.attention import Attention, AttentionMetadata, build_attention_metadata
from models.decoder import DecoderForCausalLM
from models.loader import MissingWeightError, load_model
from models.registry import MODEL_REGISTRY, UnsupportedModelError

__all__ = [
    "MODEL_REGISTRY",
    "Attention",
    "AttentionMetadata",
    "DecoderForCausalLM",
    "MissingWeightError",
    "UnsupportedModelError",
    "build_attention_metadata",
    "load_model",
]
