"""Train the demo byte-level BPE tokenizer and write `models/assets/tokenizer.json`.

Run `python -m raylane.cluster.train_tokenizer` after changing the corpus; the result is
deterministic, so rerunning without changes rewrites the same file. Creating demo models only reads
the shipped file.
"""

import argparse
from pathlib import Path

from raylane.cluster.tokenizer_corpus import corpus
from raylane.models.demo import ASSETS

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Not special: they are part of the assistant's visible output, so decoding must keep them.
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]
VOCAB_SIZE = 4096  # including special and tool tokens, so the model's vocab has no unused rows
# Qwen2's split: contractions, words with one leading non-letter, single digits (so numbers tokenize
# digit by digit), punctuation runs, newlines and whitespace.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def train_tokenizer():
    """Return a trained `tokenizers.Tokenizer` (imported here: the CLI imports this package for --help)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(TOOL_TOKENS),
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        # All 256 byte symbols are in the vocab, so any text (emoji, CJK, binary junk) encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ASSETS / "tokenizer.json")
    args = parser.parse_args(argv)
    tokenizer = train_tokenizer()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(args.out))
    print(f"wrote {args.out} ({tokenizer.get_vocab_size()} tokens)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
