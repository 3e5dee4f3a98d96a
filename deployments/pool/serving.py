"""OpenAI serving on one engine, the part chat and completions share (vLLM's `OpenAIServing`).

This is the pool replica's half of a request (the gateway validated it and built the
`SamplingParams`). `OpenAIServingChat` (`serving_chat.py`) and `OpenAIServingCompletion`
(`serving_completion.py`) each stream `PoolItem`s (deployments/protocol/wire.py): the first says how it went
(an `OpenAIError` when nothing was generated, the whole response, or a stream's first SSE events);
the last is a `FinalItem` carrying the request's `RequestSummary`. Leaving a stream early (the
client went away) aborts the engine request, which frees its KV blocks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

from raylane import tracing
from raylane.bounded_worker import WorkerBusy, WorkerStarved
from raylane.deployments.protocol.errors import OpenAIError, from_engine_value_error, invalid, unavailable
from raylane.deployments.protocol.openai_schemas import PromptTokensDetails, Usage
from raylane.deployments.protocol.wire import FinalItem, RequestSummary, ResumeState, sse_error
from raylane.engine import AsyncLLM, EngineDeadError, LoRARequest, RequestOutput, Resumption, SamplingParams
from raylane.engine.grammar_compiler import GrammarCompileService, GrammarTooComplex
from raylane.engine.output_processor import resumed_text


def sse(payload) -> str:
    return f"data: {payload.to_json()}\n\n"


class OpenAIServing:
    # The pool's `sanitize_control_tokens`: control tokens in a client's text stay text
    # (deployments/pool/chat_prompt.py).
    sanitize_control_tokens: bool = True

    def __init__(
        self, llm: AsyncLLM, model_id: str, max_model_len: int, grammar: GrammarCompileService | None = None
    ) -> None:
        """`grammar`: compiles requests' grammars off the engine loop, bounded; without it the engine
        compiles them itself."""
        self.llm = llm
        self.model_id = model_id
        self.max_model_len = max_model_len
        self.tokenizer = llm.tokenizer
        self.grammar = grammar

    def check_length(
        self, num_prompt: int, max_tokens: int | None, param: str, output_param: str = "max_tokens"
    ) -> None:
        limit = self.max_model_len
        if num_prompt >= limit:
            raise invalid(
                param,
                f"This model's maximum context length is {limit} tokens. However, your {param} resulted "
                f"in {num_prompt} tokens. Please reduce the length of the {param}.",
                code="context_length_exceeded",
            )
        if max_tokens is not None and num_prompt + max_tokens > limit:
            raise invalid(
                output_param,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in the {param}, {max_tokens} in the "
                f"completion). Please reduce the length of the {param} or completion.",
                code="context_length_exceeded",
            )

    async def _compile(self, params: SamplingParams, param: str | None, tenant: str = "") -> None:
        """Compile the request's grammar in the bounded worker (raylane.engine.grammar_compiler), so the
        engine loop only deserializes it, within `tenant`'s share of it; a grammar that is too
        complex is the client's 400."""
        if self.grammar is None or params.structured is None:
            return
        try:
            # Its wait for the worker (the key's turn) included: what a client's grammar cost it here.
            with tracing.span("pool.grammar_compile", **{"raylane.grammar_param": param}):
                await self.grammar.prepare(params.structured, tenant)
        except WorkerBusy as e:
            raise OpenAIError(
                f"This model's replica cannot compile the grammar now: {e}. Retry shortly.",
                status=429,
                param=param,
                code="server_busy" if isinstance(e, WorkerStarved) else "grammar_queue_full",
                retry_after=e.retry_after,
            ) from None
        except ValueError as e:
            code = "grammar_too_complex" if isinstance(e, GrammarTooComplex) else "invalid_value"
            raise invalid(param, f"Invalid '{param}': {str(e).split(': ', 1)[-1]}", code) from None

    def resumed_texts(
        self, prompt_ids: list[int], params: SamplingParams, resume: ResumeState | None, choices: range
    ) -> dict[int, str]:
        """The text each choice (of `choices`, one prompt's) of a resumed stream had sent, decoded as
        the engine does it, for rebuilding what the serving layer derived from that text."""
        if resume is None or self.tokenizer is None:
            return {}
        return {
            i: resumed_text(self.tokenizer, prompt_ids, params, ids)
            for i, ids in resume.token_ids.items()
            if i in choices
        }

    async def _start(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        param: str,
        priority: int = 0,
        resume: Resumption | None = None,
        tenant: str = "",
        lora_request: LoRARequest | None = None,
        cache_salt: str = "",
    ) -> tuple[RequestOutput, AsyncIterator[RequestOutput]]:
        """Add the request and wait for its first output, so that a rejected request becomes an
        error before anything is sent. `resume`: the output a failed replica had sent already. A
        traced request's carrier goes along: the engine's spans join the replica's
        (deployments/pool/pool_span.py)."""
        carrier = tracing.carrier()
        gen = self.llm.generate(
            prompt_ids,
            params,
            request_id=request_id,
            priority=priority,
            resume=resume,
            tenant=tenant,
            lora_request=lora_request,
            cache_salt=cache_salt,
            **({"trace": carrier} if carrier is not None else {}),
        )
        try:
            first = await gen.__anext__()
        except ValueError as e:
            raise from_engine_value_error(e, {"prompt": param, "structured": "response_format"}) from None
        except EngineDeadError as e:
            raise unavailable(f"The model pool's engine failed: {e}") from None
        return first, gen


def engine_resumption(resume: ResumeState | None, n: int, first_index: int = 0) -> Resumption | None:
    """The engine's view of a resumed stream's choices `first_index .. first_index + n - 1` (one
    prompt's samples)."""
    if resume is None:
        return None
    indexes = range(first_index, first_index + n)
    return Resumption(
        token_ids=tuple(tuple(resume.token_ids.get(i, ())) for i in indexes),
        finish_reasons=tuple(resume.finish_reasons.get(i) for i in indexes),
    )


def served_model(model_id: str, lora_request: LoRARequest | None) -> str:
    """The `model` a response names: the adapter's served name when one ran (as vLLM answers)."""
    return model_id if lora_request is None else lora_request.lora_name


def final_item(text: str, streams: Iterable[AsyncIterator[RequestOutput]]) -> FinalItem:
    """The response's last item, with the summary of its engine requests (whose streams have ended).
    A metered stream (`raylane.deployments.metrics.pool.MeteredStream`) has one; a bare engine's, none."""
    parts = [s for s in (getattr(stream, "summary", None) for stream in streams) if s is not None]
    return FinalItem(text, RequestSummary.merge(parts) if parts else None)


def encode(tokenizer, text: str, param: str) -> list[int]:
    """Token ids of `text`; text the tokenizer refuses (the gateway lets through only valid Unicode,
    but a pool may be called directly) is the client's error, not the pool's."""
    try:
        return tokenizer.encode(text, add_special_tokens=False)
    except (TypeError, ValueError, UnicodeError) as e:
        message = f"The tokenizer cannot encode the {param}: {e}"
        raise invalid(param, message, code="invalid_encoding") from None


def engine_failure(
    error: EngineDeadError, streaming: bool, streams: Iterable[AsyncIterator[RequestOutput]]
) -> OpenAIError | FinalItem:
    """The engine died mid-request: a 503, or in a stream that already started, the error event
    that ends it (with what was generated until then)."""
    failure = unavailable(f"The model pool's engine failed: {error}")
    if not streaming:
        return failure
    item = final_item(sse_error(failure), streams)
    item.engine_failed = True  # the gateway may resume the stream on another replica
    return item


def token_text(decoded: str | None) -> str:
    return decoded if decoded is not None else ""


@dataclass(frozen=True, slots=True)
class StreamUsage:
    """The usage a stream reports (`stream_options`): a last chunk with the whole request's
    (`include_usage`), and with vLLM's `continuous_usage_stats` also each chunk's, so far."""

    final: bool = False
    every_chunk: bool = False

    @classmethod
    def of(cls, options) -> StreamUsage:
        final = bool(options and options.include_usage)
        return cls(final, final and bool(options.continuous_usage_stats))


def usage(prompt_tokens: int, completion_tokens: list[int], output: RequestOutput) -> Usage:
    completion = sum(completion_tokens)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
        # A resumed request's cache hits may cover its earlier output too; only the prompt's count.
        prompt_tokens_details=PromptTokensDetails(cached_tokens=min(output.num_cached_tokens, prompt_tokens)),
    )


async def chain(first: RequestOutput, gen: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    yield first
    async for out in gen:  # after the finished output this ends at once, without an abort
        yield out


async def last(first: RequestOutput, gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    final = first
    async for out in chain(first, gen):
        final = out
    return final
