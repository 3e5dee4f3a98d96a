"""OpenAI chat and completions on one engine: prompts in, OpenAI responses and SSE chunks out.

This is the pool replica's half of a request (the gateway validated it and built the
`SamplingParams`). Each method is an async generator whose first item says how it went: an
`OpenAIError` (nothing was generated), the JSON text of a whole response, or the first SSE event of
a stream. Leaving a generator early (the client went away) aborts the engine request, which frees
its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing

from deployments.errors import OpenAIError, from_engine_value_error, invalid, unavailable
from deployments.openai_schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessageOut,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    FunctionCallOut,
    PromptTokensDetails,
    SystemMessage,
    TokenLogprob,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
    Usage,
)
from deployments.sampling import ToolPlan, grammar_param
from deployments.tool_calls import ContentDelta, ToolCallStreamParser, parse_tool_calls
from engine import AsyncLLM, EngineDeadError, RequestOutput, RequestOutputKind, SamplingParams
from engine.grammar_compiler import GrammarCompileService, GrammarTooComplex
from engine.outputs import CompletionOutput

DONE = "data: [DONE]\n\n"


def sse(payload) -> str:
    return f"data: {payload.to_json()}\n\n"


class OpenAIServing:
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

    # -- chat -----------------------------------------------------------------------------------

    async def chat(
        self,
        req: ChatCompletionRequest,
        params: SamplingParams,
        plan: ToolPlan,
        request_id: str,
        priority: int = 0,
    ) -> AsyncIterator[str | OpenAIError]:
        try:
            prompt_ids = self.render_chat(req, plan)
            # Name the limit as the client did (max_completion_tokens wins when both are set).
            output = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
            self.check_length(len(prompt_ids), params.max_tokens, "messages", output)
            kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
            engine_params = params.clone(output_kind=kind)
            await self._compile(engine_params, grammar_param(req))
            first, gen = await self._start(prompt_ids, engine_params, request_id, "messages", priority)
        except OpenAIError as e:
            yield e
            return
        response_id, created = f"chatcmpl-{request_id}", int(time.time())
        async with aclosing(gen):
            try:
                if not req.stream:
                    final = await _last(first, gen)
                    yield self._chat_response(final, params, plan, response_id, created).to_json()
                    return
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                chunks = self._chat_chunks(first, gen, params, plan, response_id, created, include_usage)
                async for chunk in chunks:
                    yield chunk
            except EngineDeadError as e:
                yield _engine_failure(e, bool(req.stream))

    def render_chat(self, req: ChatCompletionRequest, plan: ToolPlan) -> list[int]:
        tokenizer = self.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise invalid("model", f"{self.model_id} has no chat template; use /v1/completions.")
        messages = [_template_message(m) for m in req.messages]
        try:
            text = tokenizer.apply_chat_template(
                messages,
                tools=plan.tools if plan.mode != "none" else None,
                add_generation_prompt=True,
                tokenize=False,
                **(req.chat_template_kwargs or {}),
            )
        except Exception as e:  # jinja errors, raise_exception() in a template
            raise invalid("messages", f"The chat template rejected the messages: {e}") from None
        return _encode(tokenizer, text, "messages")

    def _chat_response(
        self, final: RequestOutput, params: SamplingParams, plan: ToolPlan, response_id: str, created: int
    ) -> ChatCompletion:
        choices = []
        for comp in final.outputs:
            content, calls = parse_tool_calls(comp.text) if plan.parse else (comp.text, [])
            message = ChatMessageOut(role="assistant", content=content)
            if calls:
                message.tool_calls = [
                    ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
                    for c in calls
                ]
            finish = plan.finish_reason if calls and comp.finish_reason == "stop" else comp.finish_reason
            choices.append(
                ChatChoice(
                    index=comp.index,
                    message=message,
                    logprobs=self._chat_logprobs(comp, params),
                    finish_reason=finish,
                )
            )
        return ChatCompletion(
            id=response_id,
            created=created,
            model=self.model_id,
            choices=choices,
            usage=_usage(len(final.prompt_token_ids), [len(c.token_ids) for c in final.outputs], final),
        )

    async def _chat_chunks(
        self,
        first: RequestOutput,
        gen: AsyncIterator[RequestOutput],
        params: SamplingParams,
        plan: ToolPlan,
        response_id: str,
        created: int,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        def chunk(index: int, delta: ChatDelta, logprobs=None, finish_reason=None) -> str:
            choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
            body = ChatCompletionChunk(id=response_id, created=created, model=self.model_id, choices=[choice])
            if include_usage:
                body.usage = None
            return sse(body)

        n = params.n
        parsers = [ToolCallStreamParser() if plan.parse else None for _ in range(n)]
        num_tokens, finished = [0] * n, [False] * n
        events = [chunk(i, ChatDelta(role="assistant", content="")) for i in range(n)]
        async for out in _chain(first, gen):
            for comp in out.outputs:
                i = comp.index
                if finished[i]:
                    continue
                num_tokens[i] += len(comp.token_ids)
                deltas = _chat_deltas(parsers[i], comp)
                logprobs = self._chat_logprobs(comp, params)
                if logprobs is not None and not deltas:
                    deltas = [ChatDelta(content="")]
                for j, delta in enumerate(deltas):
                    events.append(chunk(i, delta, logprobs if j == 0 else None))
                if comp.finished:
                    finished[i] = True
                    calls = parsers[i] is not None and parsers[i].num_calls > 0
                    reason = (
                        plan.finish_reason if calls and comp.finish_reason == "stop" else comp.finish_reason
                    )
                    events.append(chunk(i, ChatDelta(), finish_reason=reason))
            if events and not all(finished):  # the last events go out with the closing ones
                yield "".join(events)
                events = []
        if include_usage:
            body = ChatCompletionChunk(
                id=response_id,
                created=created,
                model=self.model_id,
                choices=[],
                usage=_usage(len(first.prompt_token_ids), num_tokens, first),
            )
            events.append(sse(body))
        yield "".join([*events, DONE])

    def _chat_logprobs(self, comp: CompletionOutput, params: SamplingParams) -> ChoiceLogprobs | None:
        if params.logprobs is None or comp.logprobs is None:
            return None
        content = []
        for token_id, entry in zip(comp.token_ids, comp.logprobs, strict=False):
            top = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[: params.logprobs]
            sampled = entry[token_id]
            content.append(
                TokenLogprob(
                    token=_token_text(sampled.decoded_token),
                    logprob=sampled.logprob,
                    bytes=list(_token_text(sampled.decoded_token).encode()),
                    top_logprobs=[
                        TopLogprob(
                            token=_token_text(lp.decoded_token),
                            logprob=lp.logprob,
                            bytes=list(_token_text(lp.decoded_token).encode()),
                        )
                        for _, lp in top
                    ],
                )
            )
        return ChoiceLogprobs(content=content, refusal=None)

    # -- completions ----------------------------------------------------------------------------

    async def completion(
        self, req: CompletionRequest, params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncIterator[str | OpenAIError]:
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        params = params.clone(output_kind=kind)
        started: list[tuple[RequestOutput, AsyncIterator[RequestOutput]]] = []
        try:
            prompts = [self._prompt_ids(p) for p in req.prompts()]
            for ids in prompts:
                self.check_length(len(ids), params.max_tokens, "prompt")
            await self._compile(params, grammar_param(req))
            for k, ids in enumerate(prompts):
                started.append(await self._start(ids, params, f"{request_id}-{k}", "prompt", priority))
        except OpenAIError as e:
            for _, gen in started:
                await gen.aclose()
            yield e
            return
        response_id, created = f"cmpl-{request_id}", int(time.time())
        echoes = [self._prompt_text(p) if req.echo else "" for p in req.prompts()]
        try:
            if not req.stream:
                finals = await asyncio.gather(*(_last(first, gen) for first, gen in started))
                yield self._completion_response(finals, echoes, params, response_id, created).to_json()
                return
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            async for chunk in self._completion_chunks(
                started, echoes, params, response_id, created, include_usage
            ):
                yield chunk
        except EngineDeadError as e:
            yield _engine_failure(e, bool(req.stream))
        finally:
            for _, gen in started:
                await gen.aclose()

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if self.tokenizer is None:
            raise invalid("prompt", f"{self.model_id} has no tokenizer; send token ids.")
        return _encode(self.tokenizer, prompt, "prompt")

    def _prompt_text(self, prompt: str | list[int]) -> str:
        if isinstance(prompt, str) or self.tokenizer is None:
            return prompt if isinstance(prompt, str) else ""
        return self.tokenizer.decode(prompt)

    def _completion_response(
        self,
        finals: Sequence[RequestOutput],
        echoes: list[str],
        params: SamplingParams,
        response_id: str,
        created: int,
    ) -> Completion:
        choices, prompt_tokens, completion_tokens = [], 0, []
        for k, final in enumerate(finals):
            prompt_tokens += len(final.prompt_token_ids)
            for comp in final.outputs:
                completion_tokens.append(len(comp.token_ids))
                choices.append(
                    CompletionChoice(
                        index=k * params.n + comp.index,
                        text=echoes[k] + comp.text,
                        logprobs=_completion_logprobs(comp, params, len(echoes[k])),
                        finish_reason=comp.finish_reason,
                    )
                )
        usage = _usage(prompt_tokens, completion_tokens, finals[0])
        usage.prompt_tokens_details = PromptTokensDetails(
            cached_tokens=sum(f.num_cached_tokens for f in finals)
        )
        return Completion(id=response_id, created=created, model=self.model_id, choices=choices, usage=usage)

    async def _completion_chunks(
        self,
        started: list[tuple[RequestOutput, AsyncIterator[RequestOutput]]],
        echoes: list[str],
        params: SamplingParams,
        response_id: str,
        created: int,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        def chunk(index: int, text: str, logprobs=None, finish_reason=None) -> str:
            choice = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish_reason)
            body = Completion(id=response_id, created=created, model=self.model_id, choices=[choice])
            if include_usage:
                body.usage = None
            return sse(body)

        n = params.n
        offsets = [len(echoes[k]) for k in range(len(started)) for _ in range(n)]
        num_tokens, finished = [0] * len(offsets), [False] * len(offsets)
        events = [chunk(k * n + j, echo) for k, echo in enumerate(echoes) for j in range(n if echo else 0)]
        async for k, out in _merge([_chain(first, gen) for first, gen in started]):
            for comp in out.outputs:
                index = k * n + comp.index
                if finished[index]:
                    continue
                num_tokens[index] += len(comp.token_ids)
                logprobs = _completion_logprobs(comp, params, offsets[index])
                if comp.text or logprobs is not None:
                    events.append(chunk(index, comp.text, logprobs))
                    offsets[index] += len(comp.text)
                if comp.finished:
                    finished[index] = True
                    events.append(chunk(index, "", finish_reason=comp.finish_reason))
            if events and not all(finished):  # the last events go out with the closing ones
                yield "".join(events)
                events = []
        if include_usage:
            prompt_tokens = sum(len(first.prompt_token_ids) for first, _ in started)
            body = Completion(
                id=response_id,
                created=created,
                model=self.model_id,
                choices=[],
                usage=_usage(prompt_tokens, num_tokens, started[0][0]),
            )
            events.append(sse(body))
        yield "".join([*events, DONE])

    # -- shared ---------------------------------------------------------------------------------

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

    async def _compile(self, params: SamplingParams, param: str | None) -> None:
        """Compile the request's grammar in the bounded worker (engine.grammar_compiler), so the
        engine loop only deserializes it; a grammar that is too complex is the client's 400."""
        if self.grammar is None or params.structured is None:
            return
        try:
            await self.grammar.prepare(params.structured)
        except ValueError as e:
            code = "grammar_too_complex" if isinstance(e, GrammarTooComplex) else "invalid_value"
            raise invalid(param, f"Invalid '{param}': {str(e).split(': ', 1)[-1]}", code) from None

    async def _start(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, param: str, priority: int = 0
    ) -> tuple[RequestOutput, AsyncIterator[RequestOutput]]:
        """Add the request and wait for its first output, so that a rejected request becomes an
        error before anything is sent."""
        gen = self.llm.generate(prompt_ids, params, request_id=request_id, priority=priority)
        try:
            first = await gen.__anext__()
        except ValueError as e:
            raise from_engine_value_error(e, {"prompt": param, "structured": "response_format"}) from None
        except EngineDeadError as e:
            raise unavailable(f"The model pool's engine failed: {e}") from None
        return first, gen


def _encode(tokenizer, text: str, param: str) -> list[int]:
    """Token ids of `text`; text the tokenizer refuses (the gateway lets through only valid Unicode,
    but a pool may be called directly) is the client's error, not the pool's."""
    try:
        return tokenizer.encode(text, add_special_tokens=False)
    except (TypeError, ValueError, UnicodeError) as e:
        message = f"The tokenizer cannot encode the {param}: {e}"
        raise invalid(param, message, code="invalid_encoding") from None


def _engine_failure(error: EngineDeadError, streaming: bool) -> OpenAIError | str:
    """The engine died mid-request: a 503, or in a stream that already started, an error event."""
    failure = unavailable(f"The model pool's engine failed: {error}")
    return f"data: {json.dumps(failure.to_dict())}\n\n" if streaming else failure


def _template_message(message) -> dict:
    data = message.model_dump(exclude_none=True)
    if isinstance(message, SystemMessage):
        data["role"] = "system"  # `developer` is OpenAI's new name for it
    if isinstance(message, AssistantMessage):
        data.setdefault("content", "")
    return data


def _chat_deltas(parser: ToolCallStreamParser | None, comp: CompletionOutput) -> list[ChatDelta]:
    if parser is None:
        return [ChatDelta(content=comp.text)] if comp.text else []
    events = parser.feed(comp.text) + (parser.finish() if comp.finished else [])
    deltas = []
    for ev in events:
        if isinstance(ev, ContentDelta):
            deltas.append(ChatDelta(content=ev.text))
        elif ev.name is not None:
            fn = FunctionCallOut(name=ev.name, arguments=ev.arguments)
            deltas.append(
                ChatDelta(tool_calls=[ToolCallDelta(index=ev.index, id=ev.id, type="function", function=fn)])
            )
        else:
            fn = FunctionCallOut(arguments=ev.arguments)
            deltas.append(ChatDelta(tool_calls=[ToolCallDelta(index=ev.index, function=fn)]))
    return deltas


def _completion_logprobs(
    comp: CompletionOutput, params: SamplingParams, offset: int
) -> CompletionLogprobs | None:
    if params.logprobs is None or comp.logprobs is None:
        return None
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for token_id, entry in zip(comp.token_ids, comp.logprobs, strict=False):
        sampled = entry[token_id]
        token = _token_text(sampled.decoded_token)
        top = sorted(entry.values(), key=lambda lp: -lp.logprob)[: params.logprobs]
        tokens.append(token)
        token_logprobs.append(sampled.logprob)
        top_logprobs.append({_token_text(lp.decoded_token): lp.logprob for lp in top})
        text_offset.append(offset)
        offset += len(token)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs, text_offset=text_offset
    )


def _token_text(decoded: str | None) -> str:
    return decoded if decoded is not None else ""


def _usage(prompt_tokens: int, completion_tokens: list[int], output: RequestOutput) -> Usage:
    completion = sum(completion_tokens)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=output.num_cached_tokens),
    )


async def _chain(first: RequestOutput, gen: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    yield first
    async for out in gen:  # after the finished output this ends at once, without an abort
        yield out


async def _last(first: RequestOutput, gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = first
    async for out in _chain(first, gen):
        last = out
    return last


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several streams as their items arrive, tagged with the stream's position."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(k: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for item in stream:
                await queue.put((k, item))
        except Exception as e:  # surface the failure in the consumer
            await queue.put((k, e))
        finally:
            await queue.put((k, done))

    tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            k, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield k, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
