"""Reasoning parsers (vLLM's name): a reasoning model's `<think>...</think>` text out of its answer.

A pool names its model's format (`reasoning_parser` in the pool config):

- `qwen3`: Qwen3 opens its thinking itself, with `<think>` at the start of its output; an output
  without it (thinking switched off: `enable_thinking: false`) is all answer.
- `deepseek_r1`: DeepSeek-R1 and its distillations get `<think>\\n` from their chat template, so
  the output starts inside the thinking (a `<think>` the model writes again is dropped).

In both, `</think>` ends the thinking; a thinking that never ends (cut by `max_tokens`) is all
reasoning, with no answer, because its text is thinking and not an answer a client should act on.

The parser works on text as it streams in, so a tag split over several tokens (`</`, `th`, `ink`,
`>` in a tokenizer without the tag as one token) or over several engine outputs is found all the
same: text that may be the start of a tag is held back until the next text decides. Parsing a whole
text (`split_reasoning`) runs the same parser once, so a response carries exactly what its stream
would have. The answer loses the blank lines the model writes after `</think>`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

THINK_START, THINK_END = "<think>", "</think>"
ReasoningFormat = Literal["qwen3", "deepseek_r1"]
REASONING_FORMATS: tuple[str, ...] = ("qwen3", "deepseek_r1")


@dataclass(slots=True)
class ReasoningSplit:
    reasoning: str
    content: str


class ReasoningParser:
    def __init__(self, fmt: ReasoningFormat) -> None:
        if fmt not in REASONING_FORMATS:
            raise ValueError(f"unknown reasoning parser {fmt!r}; choose from {', '.join(REASONING_FORMATS)}")
        # Until the output's first characters show whether it opens with <think>: "start".
        self._after_start = "reasoning" if fmt == "deepseek_r1" else "content"
        self._state = "start"
        # Whitespace before the output's first other character, kept as pieces so that a long run
        # of it costs linear time (it is joined once, when the next text decides what it is).
        self._lead: list[str] = []
        self._held = ""  # a tail that may begin a tag (at "start": a proper start of <think>)
        self._fed = 0  # characters fed so far
        self._strip = False  # drop whitespace at the start of the answer
        self.reasoning_end: int | None = None  # characters up to the end of `</think>`, once seen
        self.thought = False  # whether any of the output was reasoning

    def feed(self, text: str) -> ReasoningSplit:
        """The reasoning and answer text that `text` (the output's next characters) makes certain."""
        self._fed += len(text)
        buf, reasoning, content = self._held + text, [], []
        while True:
            if self._state == "start":
                lead = buf.lstrip()
                if len(lead) < len(buf):
                    self._lead.append(buf[: len(buf) - len(lead)])
                if lead.startswith(THINK_START):
                    buf, self._state, self._lead = lead[len(THINK_START) :], "reasoning", []
                elif THINK_START.startswith(lead):
                    buf = lead
                    break  # whitespace or part of <think> so far: the next text decides
                else:
                    buf, self._state, self._lead = "".join(self._lead) + lead, self._after_start, []
                continue
            if self._state == "reasoning":
                self.thought = True
                end = buf.find(THINK_END)
                if end < 0:
                    keep = _partial_suffix(buf, THINK_END)
                    reasoning.append(buf[: len(buf) - keep])
                    buf = buf[len(buf) - keep :]
                    break
                reasoning.append(buf[:end])
                buf = buf[end + len(THINK_END) :]
                self.reasoning_end = self._fed - len(buf)
                self._state, self._strip = "content", True
                continue
            if self._strip:
                buf = buf.lstrip()
                self._strip = not buf
            content.append(buf)
            buf = ""
            break
        self._held = buf
        return ReasoningSplit("".join(reasoning), "".join(content))

    def finish(self) -> ReasoningSplit:
        """What was held back, at the end of the output: a partial tag is text of the part it is in."""
        held, self._held, self._lead = "".join(self._lead) + self._held, "", []
        if self._state == "reasoning":
            return ReasoningSplit(held, "")
        if self._state == "start" and self._after_start == "reasoning":
            self.thought = self.thought or bool(held)
            return ReasoningSplit(held, "")
        return ReasoningSplit("", held if not self._strip else held.lstrip())


def split_reasoning(fmt: ReasoningFormat, text: str) -> tuple[ReasoningSplit, ReasoningParser]:
    """A whole output's reasoning and answer (the stream parser, run once), with the parser for
    `reasoning_tokens`."""
    parser = ReasoningParser(fmt)
    first, last = parser.feed(text), parser.finish()
    return ReasoningSplit(first.reasoning + last.reasoning, first.content + last.content), parser


def reasoning_tokens(parser: ReasoningParser, tokenizer, token_ids: list[int]) -> int:
    """How many of the output's tokens are its thinking, `</think>` included: the fewest leading
    tokens whose text reaches the tag's end (a binary search over decoded prefixes, so a tag split
    over tokens counts up to the token that completes it); all of them when the thinking never ended."""
    if not parser.thought:
        return 0
    if parser.reasoning_end is None:
        return len(token_ids)
    lo, hi = 0, len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(token_ids[:mid])) >= parser.reasoning_end:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
