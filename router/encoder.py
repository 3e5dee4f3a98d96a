"""MiniLM sentence embeddings tuned for routing: short inputs, int8, a cache.

The classifier needs the gist of a prompt within a few milliseconds on one core, not the
exact vectors /v1/embeddings returns, so it keeps its own copy of the packaged MiniLM
(`raylane.router.embeddings.model_path()`) and:
- reads at most `max_tokens` word pieces of each message: its head and its tail, because a
  request is usually stated at the start (then a paste) or at the end (after a paste);
- quantizes the linear layers to int8 (faster on CPU, same routing accuracy; `raylane bench router`
  times the classifier);
- caches embeddings, since a conversation resends its system prompt and earlier turns; keyed by a
  16-byte digest of the characters it reads (`model_input`), so the cache keeps no client text and
  its keys are of one size, whatever the client sends.
Pooling and normalisation are the sentence-transformers model's: mean over tokens, unit length.
"""

import hashlib
import threading
import warnings
from collections import OrderedDict

import numpy as np

PREPROCESSING = "head-tail/6-chars-per-token/mean-pool/v1"  # change when token_ids or pooling change


class SentenceEncoder:
    def __init__(self, max_tokens: int = 128, quantize: bool = True, cache_size: int = 4096):
        import torch
        from tokenizers import Tokenizer
        from transformers import AutoModel

        from raylane.router.embeddings import model_path

        path = model_path()
        self.max_tokens = max_tokens
        self._tokenizer = Tokenizer.from_file(f"{path}/tokenizer.json")
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        self._cls, self._sep = self._tokenizer.token_to_id("[CLS]"), self._tokenizer.token_to_id("[SEP]")
        model = AutoModel.from_pretrained(path, local_files_only=True).eval()
        self._model = _quantized(model) if quantize else model
        self.quantized = self._model is not model
        self._torch = torch
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()  # text_key(text) -> vector
        self._cache_size = cache_size
        self._lock = threading.Lock()  # one forward at a time; the cache is shared state

    @property
    def fingerprint(self) -> str:
        """Everything that decides the vectors, for caches of them kept outside this process."""
        import torch

        from raylane.router.embeddings import model_path

        return f"{model_path()}|{torch.__version__}|{self.max_tokens}|{self.quantized}|{PREPROCESSING}"

    @property
    def dim(self) -> int:
        return self._model.config.hidden_size

    def encode(self, texts: list[str], batch_size: int = 32) -> np.ndarray:
        """[len(texts), dim] float32 unit vectors."""
        inputs = [self.model_input(t) for t in texts]
        keys = [text_key(t) for t in inputs]
        with self._lock:
            known = {k: self._cache[k] for k in keys if k in self._cache}
            missing = {k: self._token_ids(t) for k, t in zip(keys, inputs, strict=True) if k not in known}
            by_length = sorted(missing, key=lambda k: len(missing[k]))  # batches of similar length pad less
            for start in range(0, len(by_length), batch_size):
                batch = by_length[start : start + batch_size]
                vectors = self._forward([missing[k] for k in batch])
                known.update(zip(batch, vectors, strict=True))
            for key in keys:
                self._remember(key, known[key])
            return np.stack([known[k] for k in keys]) if texts else np.zeros((0, self.dim), np.float32)

    def remember(self, texts: list[str], vectors: np.ndarray) -> None:
        """Seed the cache with embeddings computed earlier (e.g. loaded from disk)."""
        with self._lock:
            for text, vector in zip(texts, vectors, strict=True):
                self._remember(text_key(self.model_input(text)), vector)

    def count_tokens(self, text: str) -> int:
        """Word pieces of the whole text with [CLS] and [SEP], before the classifier's cut."""
        return len(self._tokenizer.encode(text).ids)

    def model_input(self, text: str) -> str:
        """The characters of `text` the model reads: all of a short text, the head and tail of a long one.
        Word pieces average 3-5 characters, even in code: 6 a token skips tokenizing a huge paste."""
        chars = (self.max_tokens - 2) * 6
        return text if len(text) <= 2 * chars else text[:chars] + "\n" + text[-chars:]

    def token_ids(self, text: str) -> list[int]:
        """[CLS] head ... tail [SEP], at most max_tokens ids."""
        return self._token_ids(self.model_input(text))

    def _token_ids(self, text: str) -> list[int]:
        budget = self.max_tokens - 2
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        if len(ids) > budget:
            head = budget - budget // 2
            ids = ids[:head] + ids[len(ids) - budget // 2 :]
        return [self._cls, *ids, self._sep]

    def _forward(self, batch: list[list[int]]) -> np.ndarray:
        torch = self._torch
        width = max(len(ids) for ids in batch)
        input_ids = torch.zeros((len(batch), width), dtype=torch.long)  # [PAD] is id 0
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, ids in enumerate(batch):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            mask[i, : len(ids)] = 1
        with torch.inference_mode():
            hidden = self._model(input_ids=input_ids, attention_mask=mask).last_hidden_state
            summed = (hidden * mask.unsqueeze(-1)).sum(1)
            pooled = summed / mask.sum(1, keepdim=True)
            return torch.nn.functional.normalize(pooled, dim=-1).numpy().astype(np.float32)

    def _remember(self, key: bytes, vector: np.ndarray) -> None:
        self._cache[key] = vector
        self._cache.move_to_end(key)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)


def text_key(text: str) -> bytes:
    """A cache key of one size for any text: its 16-byte BLAKE2b digest. "surrogatepass" because the
    training set is the project's text, and a client's was checked for lone surrogates at the gateway."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _quantized(model):
    """int8 dynamic quantization of nn.Linear, or the model unchanged where torch lacks it."""
    import torch

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao.quantization announces its move to torchao
            from torch.ao.quantization import quantize_dynamic

            return quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    except (ImportError, RuntimeError, AttributeError):
        return model
