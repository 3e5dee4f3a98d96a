"""A checkpoint's tokenizer and end-of-sequence ids, as the engine and `AsyncLLM` load them."""

import os

from raylane.models.gguf_sidecar import checkpoint_dir


def load_tokenizer(path: str):
    """The checkpoint's tokenizer, or None for a checkpoint without one (token-id prompts only)."""
    from transformers import AutoTokenizer

    path = checkpoint_dir(path)
    if not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    return AutoTokenizer.from_pretrained(path)


def eos_token_ids(model_dir: str, hf_config, tokenizer) -> frozenset[int]:
    """Every id that ends a generation: the generation config's (one or a list), else the model
    config's, and the tokenizer's own."""
    ids: set[int] = set()
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(checkpoint_dir(model_dir)).eos_token_id
    except OSError:
        eos = getattr(hf_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
