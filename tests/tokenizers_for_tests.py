"""A small byte-level BPE tokenizer trained in-process, so unit tests never touch the HF hub."""

from __future__ import annotations

import functools
import json
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"

# Mixed prose, accents, CJK, emoji and JSON: enough for merges of common ASCII while rarer
# multi-byte characters stay split over several byte tokens (what the detokenizer must handle).
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. A cat sat on the mat and looked at the hat.",
    "Serving large language models needs batching, paged attention and a careful scheduler.",
    "Café crème brûlée, naïve résumé, façade, jalapeño, São Paulo, Zürich, Kraków, Ångström.",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "Emoji: 🚀 launch, 🎉 party, 👍 ok, 🐍 python, 🦀 rust, ❤️ love, 👨‍👩‍👧 family.",
    "def add(a: int, b: int) -> int:\n    return a + b\n\nprint(add(1, 2))\n",
    "Stop words like END and ### or </s> often terminate generation early.",
]
_SYLLABLES = "ka to ri mu sen dor pli qua zet van lo bri ex ion ter ght sch ow ä é 的 ü"
_JSON = [
    {"name": "Alice", "age": 30, "tags": ["admin", "dev"], "active": True, "score": 9.5},
    {"id": 17, "items": [{"sku": "A-1", "qty": 2}, {"sku": "B-22", "qty": 1}], "note": None},
    {"city": "Berlin", "country": "DE", "population": 3645000, "coords": [52.52, 13.405]},
    {"status": "ok", "result": {"value": -42, "unit": "ms"}, "errors": []},
]


@functools.cache
def make_tokenizer(vocab_size: int = 1000) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE (GPT-2 style) with `<|endoftext|>` as eos; cached per process."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Seeded pseudo-words give BPE enough distinct pairs to actually reach `vocab_size`.
    rng = random.Random(0)
    syl = _SYLLABLES.split()
    words = ["".join(rng.choices(syl, k=rng.randint(1, 4))) for _ in range(4 * vocab_size)]
    text = _CORPUS * 3 + [json.dumps(j) for j in _JSON] * 3 + [json.dumps(j, indent=2) for j in _JSON]
    text += [" ".join(words[i : i + 16]) for i in range(0, len(words), 16)]
    tok.train_from_iterator(text, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=EOS, clean_up_tokenization_spaces=False
    )
