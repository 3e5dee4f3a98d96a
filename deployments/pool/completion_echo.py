"""What a completions choice repeats of its prompt (`echo`), and how `max_tokens: 0` shows.

`echo` puts the prompt's text before the completion's; with `logprobs` too, the prompt's tokens lead
the choice's `logprobs` with the engine's prompt logprobs (the first token's null: it has no context),
as OpenAI's legacy API and vLLM return them and lm-eval's loglikelihood tasks read them. Their text
offsets count from 0 over the prompt tokens' strings; the completion's from the end of the echoed text.
`max_tokens: 0` with `echo` is the prompt alone: the engine samples one token
(deployments/protocol/sampling.py), which is dropped here, so the engine needs no case of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from raylane.deployments.pool.logprobs import completion_logprobs
from raylane.deployments.protocol.openai_schemas import CompletionLogprobs, CompletionRequest
from raylane.deployments.protocol.wire import FinalItem
from raylane.engine import RequestOutput, SamplingParams
from raylane.engine.outputs import CompletionOutput


@dataclass(slots=True)
class Echo:
    """`texts`: each prompt's text ("" without `echo`). `logprobs`: the top-k of the prompt tokens'
    logprobs (None: echo without logprobs, or no echo). `only`: the prompt alone (max_tokens 0)."""

    texts: list[str]
    logprobs: int | None
    only: bool
    decode: Callable[[int], str]  # one token id's string, for the first prompt token (no logprob entry)

    @classmethod
    def of(
        cls, req: CompletionRequest, params: SamplingParams, texts: list[str], decode: Callable[[int], str]
    ) -> Echo:
        echo = bool(req.echo)
        logprobs = params.logprobs if echo else None
        return cls(texts if echo else [""] * len(texts), logprobs, echo and req.max_tokens == 0, decode)

    def prompt_logprobs(self, output: RequestOutput) -> CompletionLogprobs | None:
        """The echoed prompt's part of the choice's `logprobs` (None without echo and logprobs)."""
        if self.logprobs is None:
            return None
        ids = output.prompt_token_ids
        entries = output.prompt_logprobs or [None] * len(ids)  # (none: a resumed stream's, never shown)
        return completion_logprobs(ids, entries, self.logprobs, 0, self.decode)

    def completion(self, comp: CompletionOutput) -> CompletionOutput:
        """A choice's output as the client sees it: with `only`, no text, no token, and "length"."""
        if not self.only:
            return comp
        logprobs = None if comp.logprobs is None else []
        reason = "length" if comp.finished else None
        return replace(comp, text="", token_ids=[], logprobs=logprobs, finish_reason=reason, stop_reason=None)

    def counted(self, item: FinalItem) -> FinalItem:
        """The response's last item, its summary (the request log, the key's rate limit) counting what
        the client got: with `only`, no completion token (the engine's metrics still count the one it
        sampled)."""
        if self.only and item.summary is not None:
            item.summary.completion_tokens = 0
        return item
