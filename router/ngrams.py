"""Hashed character n-grams of a text: the classifier's lexical features beside MiniLM's embedding.

MiniLM was trained on English, so a Spanish or French request embeds close to other text in that
language more than to its route. Sub-word pieces carry across languages and survive typos:
`fonction` shares `nct`/`cti`/`tio` with `function`, `función` shares `<fun`; `probabilidad`,
`probabilité` and `probability` share `probab`; `git`, `SQL`, `=`, `{` and `x²` read the same in
every language. As in fastText, each word is padded as `<word>` and split into its 3-, 4- and
5-grams, with the whole word as one more feature; accents are stripped and case folded first.
The n-grams are hashed into `dim` buckets with CRC-32 (stable across processes, unlike `hash()`),
counts are log-scaled and each row has unit length, like the embedding it is concatenated with, so
the two halves weigh the same before training decides.
"""

import re
import unicodedata
import zlib

import numpy as np

# Buckets: fewer collisions between languages than 512; chosen on the development conversations.
NGRAM_DIM = 4096
NGRAM_SIZES = (3, 4, 5)
_TOKEN = re.compile(r"\w+|[^\w\s]")  # words, and each punctuation or symbol character on its own


def fold(text: str) -> str:
    """Lower case without accents: `Ecuación` -> `ecuacion`."""
    decomposed = unicodedata.normalize("NFKD", text.lower())
    return "".join(ch for ch in decomposed if not unicodedata.combining(ch))


def ngram_features(texts: list[str], dim: int = NGRAM_DIM, max_chars: int = 1536) -> np.ndarray:
    """[len(texts), dim] float32 rows of unit length (all zeros for a text without a word).

    A text longer than `max_chars` is read at its head and tail, as the encoder reads it.
    """
    out = np.zeros((len(texts), dim), np.float32)
    for row, text in enumerate(texts):
        if len(text) > max_chars:
            text = text[: max_chars // 2] + "\n" + text[-(max_chars // 2) :]
        counts: dict[int, int] = {}
        for word in _TOKEN.findall(fold(text)):
            padded = f"<{word}>"
            grams = [f"w:{word}"]
            for n in NGRAM_SIZES:
                grams += [padded[i : i + n] for i in range(max(1, len(padded) - n + 1))]
            for gram in grams:
                bucket = zlib.crc32(gram.encode()) % dim
                counts[bucket] = counts.get(bucket, 0) + 1
        if counts:
            values = np.log1p(np.fromiter(counts.values(), np.float32, len(counts)))
            out[row, np.fromiter(counts, np.int64, len(counts))] = values / np.linalg.norm(values)
    return out


# The opening: how a turn starts says whether it continues the conversation (`¿y cómo...`, `et si...`,
# `and what if...`) or leaves it (`Cambiando de tema:`, `Et sinon,`, `Unrelated:`), in words that the
# content n-grams above drown out in a long turn. Six tokens reach past a leading thanks (`¡ gracias !`).
OPENING_DIM = 1024
OPENING_TOKENS = 6


def opening_features(
    texts: list[str], dim: int = OPENING_DIM, num_tokens: int = OPENING_TOKENS
) -> np.ndarray:
    """[len(texts), dim] float32 rows of unit length: the first `num_tokens` tokens of each text
    (folded, punctuation included) as words and adjacent pairs, and the first token on its own."""
    out = np.zeros((len(texts), dim), np.float32)
    for row, text in enumerate(texts):
        tokens = _TOKEN.findall(fold(text[:200]))[:num_tokens]
        if not tokens:
            continue
        grams = [f"first:{tokens[0]}", *(f"o:{t}" for t in tokens)]
        grams += [f"o:{a}_{b}" for a, b in zip(tokens, tokens[1:], strict=False)]
        for gram in grams:
            out[row, zlib.crc32(gram.encode()) % dim] += 1.0
        out[row] /= np.linalg.norm(out[row])
    return out
