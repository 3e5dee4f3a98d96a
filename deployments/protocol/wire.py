"""What crosses the Serve handle from a pool replica to the gateway.

A pool's `chat` / `completions` / `responses` stream yields `PoolItem`s. The first says how the
request went: an `OpenAIError` (nothing was generated; the gateway may fall back to another pool),
the whole JSON response, or the first SSE text of a stream. A stream's later items are SSE text too. The
response's **last item** is a `FinalItem`: its text (the JSON body, the events ending in `[DONE]`,
or the error event that ends a stream the engine's failure cut) together with the request's
`RequestSummary`, so the gateway ends the HTTP response and fills its request log on one message,
without waiting for another one or for the end of the pool's stream.

The SSE text is made in the pool, so the gateway relays it as it is (one message per engine output).
A stream's items other than the last are `StreamItem`s: the text with the token ids it carries, per
choice, which never reach the client. With them the gateway can resume a stream whose replica died
(deployments/gateway/resumption.py): it calls the pool again with a `ResumeState`, and the continuation
prefills the prompt plus those tokens and sends only what comes after them.

A replica whose engine died raises `EngineDeadError` through the handle: the gateway takes it from
here, as it takes the rest of what crosses, so its modules import nothing of the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from raylane.deployments.protocol.errors import OpenAIError
from raylane.engine.errors import EngineDeadError as EngineDeadError  # the gateway's, from here

if TYPE_CHECKING:
    from raylane.deployments.protocol.openai_schemas import ChatCompletionRequest, CompletionRequest
    from raylane.deployments.protocol.sampling import ToolPlan
    from raylane.engine.sampling_params import SamplingParams

DONE = "data: [DONE]\n\n"
ERROR_EVENT_PREFIX = 'data: {"error"'


@dataclass(slots=True)
class RequestSummary:
    """A finished request's tokens, TTFT and finish reasons, for the gateway's request log. A
    completions request with several prompts (several engine requests) has their merged summary."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None
    finish_reasons: list[str] = field(default_factory=list)

    @property
    def finish_reason(self) -> str | None:
        return ",".join(dict.fromkeys(self.finish_reasons)) or None

    @staticmethod
    def merge(parts: list[RequestSummary]) -> RequestSummary:
        ttfts = [p.ttft_s for p in parts if p.ttft_s is not None]
        return RequestSummary(
            prompt_tokens=sum(p.prompt_tokens for p in parts),
            completion_tokens=sum(p.completion_tokens for p in parts),
            cached_tokens=sum(p.cached_tokens for p in parts),
            ttft_s=min(ttfts) if ttfts else None,
            finish_reasons=[r for p in parts for r in p.finish_reasons],
        )


@dataclass(slots=True)
class FinalItem:
    """A response's last item with its request's summary (None where the engine request left none:
    an engine without metering, or one that failed before its prefill)."""

    item: str
    summary: RequestSummary | None = None
    engine_failed: bool = False  # the engine died: `item` is the error event; the stream may resume


@dataclass(slots=True)
class StreamItem:
    """SSE text of a stream and what it carries, per choice index: the generated token ids whose text
    it holds and, for a choice that ended in it, the finish reason."""

    text: str
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    finish_reasons: dict[int, str] = field(default_factory=dict)


@dataclass(slots=True)
class ResumeState:
    """Where a stream stood when its replica failed, for the pool that continues it: per choice index,
    the token ids whose text the client has and the finish reason of a choice that had ended; the
    response's `created` (its `id` comes from the request id, which stays the same); how many SSE
    events the client got (a Responses stream numbers its events: `sequence_number` goes on from it)."""

    created: int
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    finish_reasons: dict[int, str] = field(default_factory=dict)
    num_events: int = 0

    def add(self, item: StreamItem) -> None:
        for index, ids in item.token_ids.items():
            self.token_ids.setdefault(index, []).extend(ids)
        self.finish_reasons.update(item.finish_reasons)
        # Each SSE event ends with a blank line; JSON data escapes its own newlines.
        self.num_events += item.text.count("\n\n")

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.token_ids.values())


PoolItem = str | OpenAIError | FinalItem | StreamItem


@dataclass(frozen=True, slots=True)
class AdapterRef:
    """A LoRA adapter as the gateway names it to a pool: its served name and its PEFT directory in
    each pool that serves it under that name (the gateway's config and run-time loads decide both;
    a pool replica holds no list of its own, so an adapter loaded at run time needs no restart)."""

    name: str
    paths: tuple[tuple[str, str], ...]  # (pool, directory)

    def path(self, pool: str) -> str:
        return dict(self.paths)[pool]


@dataclass(frozen=True, slots=True)
class PoolRequest:
    """One request as the gateway hands it to a pool, whole: the pool method that serves it
    (`endpoint`), the OpenAI request (for `responses`, the chat request it maps to), its sampling
    parameters, the tool plan (chat, responses), the fields a Responses object repeats (`echo`), its
    id; then what the gateway decides per call: the tier's `priority` and the caller's key id as
    `tenant` (the engine schedules by both), the LoRA `adapter` the client named (by its served
    name), when a stream goes on after its replica died, the stream's `resume` state, and per call
    the W3C `trace` carrier."""

    endpoint: Literal["chat", "completions", "responses"]
    body: ChatCompletionRequest | CompletionRequest
    params: SamplingParams
    request_id: str
    tools: ToolPlan | None = None
    echo: dict | None = None
    priority: int = 0
    tenant: str = ""
    # Prefix-cache scope (vLLM's cache_salt): requests share cached blocks only within one salt,
    # by default their key's (gateway.prefix_cache_sharing).
    cache_salt: str = ""
    adapter: AdapterRef | None = None
    resume: ResumeState | None = None
    # The W3C trace context (`traceparent`, `tracestate`) of the gateway's span of this call: the pool
    # replica's spans continue it (raylane/tracing.py). None: not traced.
    trace: dict[str, str] | None = None

    def call(
        self, handle: Any, resume: ResumeState | None = None, trace: dict[str, str] | None = None
    ) -> Any:
        """The pool's streaming call for this request on `handle` (a pool's Serve handle), with its
        `resume` state and the trace `carrier` of the gateway's span of the call."""
        method = getattr(handle.options(stream=True), self.endpoint)
        changes = {k: v for k, v in (("resume", resume), ("trace", trace)) if v is not None}
        return method.remote(replace(self, **changes) if changes else self)


def sse_error(error: OpenAIError) -> str:
    """An error as the SSE event that ends a stream (OpenAI's SDK raises it)."""
    return f"data: {json.dumps(error.to_dict())}\n\n"


def is_error_event(text: str) -> bool:
    return text.startswith(ERROR_EVENT_PREFIX)
