"""Incremental detokenization with stop strings.

Decoding the whole completion every step costs O(n) per token, and decoding one token at a time is
wrong for tokenizers whose text depends on neighbours (SentencePiece leading spaces, byte-level BPE
splitting one UTF-8 character over several tokens). Like vLLM, we keep a short window of ids:
`prefix_offset..read_offset` is already emitted context, `read_offset..` is pending. Each step
decodes the window with and without the pending ids; the difference is the new text. A trailing
U+FFFD means a character is still incomplete, so the pending ids wait for the next token.
"""

from __future__ import annotations

from typing import Any

# Prompt ids kept as left context for the first completion tokens (vLLM uses the same number).
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        # Only the window is stored; offsets index into it.
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._pending = ""  # decoded text not yet emitted (may be the start of a stop string)
        self._text = ""  # emitted text
        self._max_stop = max((len(s) for s in self.stop), default=0)
        # As vLLM: stop strings count only once more than min_tokens tokens are out; text before that
        # is shown as it comes, and a stop string wholly inside it is not matched later.
        self._min_tokens = min_tokens
        self._num_tokens = 0
        self.stopped_by: str | None = None

    @property
    def text(self) -> str:
        return self._text

    def _decode(self, ids: list[int]) -> str:
        # No cleanup: it rewrites spaces around punctuation differently per window.
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _decode_pending(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith(_REPLACEMENT) and not final):
            return ""  # nothing visible yet (special token skipped) or a character still incomplete
        self._ids = self._ids[self._read_offset :]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        return new_text[len(prefix_text) :]

    def update(self, new_token_ids: list[int]) -> str:
        """Add sampled ids; return the text that is now safe to show."""
        if self.stopped_by is not None:
            return ""
        self._ids.extend(new_token_ids)
        self._num_tokens += len(new_token_ids)
        return self._advance(self._decode_pending(final=False), final=False)

    def flush(self) -> str:
        """The request ended for another reason (length, eos): release everything held back."""
        if self.stopped_by is not None:
            return ""
        return self._advance(self._decode_pending(final=True), final=True)

    def _advance(self, delta: str, final: bool) -> str:
        pending = self._pending + delta
        checking = self.stop and self._num_tokens > self._min_tokens
        if checking:
            # A new match must end inside `delta`, so search only the last emitted characters
            # (a shown stop prefix is possible with include_stop_str_in_output) plus pending.
            ctx = self._text[max(0, len(self._text) - self._max_stop + 1) :]
            buf = ctx + pending
            start = max(0, len(buf) - len(delta) - self._max_stop + 1)
            hits = [(i, s) for s in self.stop if (i := buf.find(s, start)) >= 0]
            if hits:
                i, s = min(hits, key=lambda h: (h[0], -len(h[1])))
                self.stopped_by = s
                out = buf[len(ctx) : max(len(ctx), i + len(s) if self.include_stop_str_in_output else i)]
                self._pending = ""
                self._text += out
                return out
        hold = 0 if final or not checking else self._held_back(pending)
        out, self._pending = pending[: len(pending) - hold], pending[len(pending) - hold :]
        self._text += out
        return out

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        if self.include_stop_str_in_output:
            return 0  # the stop string would be shown anyway, so a partial one can go out early
        for n in range(min(self._max_stop - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
