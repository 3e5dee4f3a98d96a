"""The tokens a simulated request generates: a function of its prompt (and seed and sample index) and
the output position, nothing else, so the same request gets the same answer on every replica and
engine, and a request resumed on another replica goes on exactly where the first one stopped.

Tokens are drawn from the stand-in tokenizer's ordinary words (a space and 3 to 10 lowercase letters),
so the text reads as words and never holds a special token. An answer ends with EOS after its natural
length, drawn from the prompt in the profile's `natural_output_tokens` range, unless `ignore_eos` (then
`max_tokens` ends it) or `min_tokens` holds it longer. Stop strings and stop token ids apply as usual:
the output processor sees these tokens as it sees a model's.
"""

import hashlib
import re
from array import array

from raylane.engine.request import Request

MASK = (1 << 64) - 1
WORD = re.compile(r"^[\u0120\u2581][a-z]{3,10}$")  # byte-level BPE's and SentencePiece's space marks


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def word_ids(tokenizer) -> list[int]:
    special = set(tokenizer.all_special_ids)
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    ids = [i for i, p in enumerate(pieces) if p and WORD.match(p) and i not in special]
    if len(ids) < 256:
        raise ValueError(f"tokenizer: only {len(ids)} ordinary word tokens; the simulated engine needs 256")
    return ids


class SimulatedTokens:
    def __init__(self, tokenizer, eos_token_ids: frozenset[int], natural_output_tokens: tuple[int, int]):
        self.words = word_ids(tokenizer)
        self.eos = min(eos_token_ids) if eos_token_ids else None
        self.natural = natural_output_tokens
        self._seeds: dict[str, int] = {}  # running request id -> its seed (hashing the prompt once)

    def seed(self, request: Request) -> int:
        seed = self._seeds.get(request.request_id)
        if seed is None:
            h = hashlib.blake2b(array("q", request.prompt_token_ids).tobytes(), digest_size=8)
            h.update(b"%d:%d" % (request.sampling_params.seed or 0, request.index))
            seed = self._seeds[request.request_id] = int.from_bytes(h.digest(), "little")
        return seed

    def forget(self, request: Request) -> None:
        self._seeds.pop(request.request_id, None)

    def natural_length(self, request: Request) -> int:
        low, high = self.natural
        return low + self.seed(request) % (high - low + 1)

    def next_token(self, request: Request) -> tuple[int, tuple[float, list[tuple[int, float]]] | None]:
        """The request's next token and, when it asked for logprobs, made-up ones: the token first (the
        most likely), then `logprobs` - 1 other words, each less likely than the one before."""
        params, position = request.sampling_params, request.num_output_tokens
        seed = self.seed(request)
        h = splitmix64(seed + position)
        token = self.words[h % len(self.words)]
        ends = self.eos is not None and not params.ignore_eos and position >= params.min_tokens
        if ends and position >= self.natural_length(request):
            token = self.eos
        if params.logprobs is None:
            return token, None
        chosen = -((h >> 32) % 1000) / 2000  # in (-0.5, 0]
        top = [(token, chosen)]
        for j in range(1, params.logprobs):
            top.append((self.words[splitmix64(h + j) % len(self.words)], chosen - 0.75 * j))
        return token, (chosen, top[: params.logprobs])
