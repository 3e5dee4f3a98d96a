"""`/v1/chat/completions` on one engine (vLLM's `OpenAIServingChat`): messages through the chat
template, tool calls parsed from the text, a whole response or SSE chunks out."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from raylane import tracing
from raylane.deployments.pool.chat_prompt import chat_prompt_ids
from raylane.deployments.pool.logprobs import chat_logprobs, vllm_prompt_logprobs
from raylane.deployments.pool.reasoning_parser import ReasoningParser, reasoning_tokens, split_reasoning
from raylane.deployments.pool.serving import (
    OpenAIServing,
    StreamUsage,
    chain,
    engine_failure,
    engine_resumption,
    final_item,
    last,
    served_model,
    sse,
    usage,
)
from raylane.deployments.pool.tokenize_offload import tokenize_off_loop
from raylane.deployments.protocol.errors import OpenAIError
from raylane.deployments.protocol.openai_schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessageOut,
    CompletionTokensDetails,
    FunctionCallOut,
    ToolCallDelta,
    ToolCallOut,
)
from raylane.deployments.protocol.sampling import ToolPlan, grammar_param
from raylane.deployments.protocol.tool_calls import ContentDelta, ToolCallStreamParser, parse_tool_calls
from raylane.deployments.protocol.wire import DONE, PoolItem, ResumeState, StreamItem
from raylane.engine import EngineDeadError, RequestOutput, RequestOutputKind, SamplingParams
from raylane.engine.lora import LoRARequest
from raylane.engine.outputs import CompletionOutput


class OpenAIServingChat(OpenAIServing):
    reasoning_parser: str | None = (
        None  # the pool's `reasoning_parser` (deployments/pool/reasoning_parser.py)
    )

    async def chat(
        self,
        req: ChatCompletionRequest,
        params: SamplingParams,
        plan: ToolPlan,
        request_id: str,
        priority: int = 0,
        resume: ResumeState | None = None,
        tenant: str = "",
        lora_request: LoRARequest | None = None,
        cache_salt: str = "",
    ) -> AsyncIterator[PoolItem]:
        """`resume`: continue a stream that a failed replica began (deployments/protocol/wire.py)."""
        # Name the limit as the client did (max_completion_tokens wins when both are set).
        output = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        try:
            prompt_ids, engine_params, first, gen = await self.start_chat(
                req, params, plan, request_id, output, priority, resume, tenant, lora_request, cache_salt
            )
        except OpenAIError as e:
            yield e
            return
        response_id = f"chatcmpl-{request_id}"
        created = resume.created if resume is not None else int(time.time())
        model = served_model(self.model_id, lora_request)
        async with aclosing(gen):
            try:
                if not req.stream:
                    final = await last(first, gen)
                    # Reasoning is split and its tokens counted (decoding the output) off the loop
                    # when the output is long (deployments/pool/tokenize_offload.py).
                    build = lambda: self._chat_response(final, params, plan, response_id, created, model)  # noqa: E731
                    body = (await tokenize_off_loop(build, [c.token_ids for c in final.outputs])).to_json()
                    yield final_item(body, [gen])
                    return
                report = StreamUsage.of(req.stream_options)
                shown = self.resumed_texts(prompt_ids, engine_params, resume, range(params.n))
                chunks = self._chat_chunks(
                    first, gen, params, plan, response_id, created, model, report, resume, shown
                )
                async for chunk in chunks:
                    yield chunk
            except EngineDeadError as e:
                yield engine_failure(e, bool(req.stream), [gen])

    async def start_chat(
        self,
        req: ChatCompletionRequest,
        params: SamplingParams,
        plan: ToolPlan,
        request_id: str,
        output_param: str,
        priority: int,
        resume: ResumeState | None,
        tenant: str,
        lora_request: LoRARequest | None,
        cache_salt: str,
    ) -> tuple[list[int], SamplingParams, RequestOutput, AsyncIterator[RequestOutput]]:
        """Chat's and Responses' way into the engine: the prompt rendered and its length checked (the
        limit named `output_param`), the grammar compiled within `tenant`'s share, the request
        started: (prompt ids, the engine's parameters, its first output, the rest)."""
        with tracing.span("pool.render") as span:  # the chat template, and its tokens in the same call
            prompt_ids = await self.prompt_ids(req, plan)
            tracing.set_attributes(span, **{"gen_ai.usage.input_tokens": len(prompt_ids)})
        self.check_length(len(prompt_ids), params.max_tokens, "messages", output_param)
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        engine_params = params.clone(output_kind=kind)
        await self._compile(engine_params, grammar_param(req), tenant)
        resumed = engine_resumption(resume, params.n)
        first, gen = await self._start(
            prompt_ids,
            engine_params,
            request_id,
            "messages",
            priority,
            resumed,
            tenant,
            lora_request,
            cache_salt,
        )
        return prompt_ids, engine_params, first, gen

    async def prompt_ids(self, req: ChatCompletionRequest, plan: ToolPlan) -> list[int]:
        """`render_chat`, off the event loop for a large prompt (deployments/pool/tokenize_offload.py)."""
        return await tokenize_off_loop(lambda: self.render_chat(req, plan), req.messages, plan.tools)

    def render_chat(self, req: ChatCompletionRequest, plan: ToolPlan) -> list[int]:
        tools = plan.tools if plan.mode != "none" else None
        return chat_prompt_ids(
            self.tokenizer,
            self.model_id,
            req.messages,
            tools,
            req.chat_template_kwargs,
            sanitize_control_tokens=self.sanitize_control_tokens,
        )

    def _chat_response(
        self,
        final: RequestOutput,
        params: SamplingParams,
        plan: ToolPlan,
        response_id: str,
        created: int,
        model: str,
    ) -> ChatCompletion:
        choices = []
        for comp in final.outputs:
            reasoning, text = self._split_reasoning(comp)
            content, calls = parse_tool_calls(text, plan.forced) if plan.parse else (text, [])
            message = ChatMessageOut(role="assistant", content=content)
            if reasoning is not None:
                message.reasoning_content = reasoning
                message.content = content or None  # a thinking that never ended left no answer
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
                    logprobs=chat_logprobs(comp, params.logprobs),
                    finish_reason=finish,
                )
            )
        body = ChatCompletion(
            id=response_id,
            created=created,
            model=model,
            choices=choices,
            usage=usage(len(final.prompt_token_ids), [len(c.token_ids) for c in final.outputs], final),
        )
        if final.prompt_logprobs is not None:
            body.prompt_logprobs = vllm_prompt_logprobs(final.prompt_logprobs)
        if self.reasoning_parser is not None:
            thinking = sum(self._split_reasoning(comp, count=True)[0] for comp in final.outputs)
            body.usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=thinking)
        return body

    def _split_reasoning(self, comp: CompletionOutput, count: bool = False) -> tuple:
        """(reasoning or None, answer) of a finished choice; with `count`, (its reasoning tokens, answer)."""
        if self.reasoning_parser is None:
            return (0 if count else None), comp.text
        split, parser = split_reasoning(self.reasoning_parser, comp.text)
        if count:
            return reasoning_tokens(parser, self.tokenizer, list(comp.token_ids)), split.content
        return (split.reasoning if parser.thought else None), split.content

    async def _chat_chunks(
        self,
        first: RequestOutput,
        gen: AsyncIterator[RequestOutput],
        params: SamplingParams,
        plan: ToolPlan,
        response_id: str,
        created: int,
        model: str,
        report: StreamUsage,
        resume: ResumeState | None = None,
        shown: dict[int, str] | None = None,
    ) -> AsyncIterator[PoolItem]:
        """Each item carries the token ids whose text it holds (`StreamItem`). A resumed stream
        (`resume`, with `shown` the text each unfinished choice had sent) sends no role chunks again;
        its tool-call parsers are rebuilt by feeding them that text and dropping what they say, so call
        indexes and held-back markup carry on; its usage counts the tokens sent before too."""

        def chunk(index: int, delta: ChatDelta, logprobs=None, finish_reason=None) -> str:
            choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
            body = ChatCompletionChunk(id=response_id, created=created, model=model, choices=[choice])
            if report.final:  # null in every chunk but the last, unless usage so far is asked for
                body.usage = usage(prompt_tokens, num_tokens, first) if report.every_chunk else None
            return sse(body)

        n, prompt_tokens = params.n, len(first.prompt_token_ids)
        parsers = [ToolCallStreamParser(plan.forced) if plan.parse else None for _ in range(n)]
        thinkers = [
            ReasoningParser(self.reasoning_parser) if self.reasoning_parser else None for _ in range(n)
        ]
        output_ids: list[list[int]] = [[] for _ in range(n)]  # for usage's reasoning_tokens
        num_tokens, finished = [0] * n, [False] * n
        events = [chunk(i, ChatDelta(role="assistant", content="")) for i in range(n)]
        if resume is not None:  # replay what was sent through the same parsing, dropping its deltas
            events = []
            for i in range(n):
                sent = resume.token_ids.get(i, [])
                num_tokens[i], finished[i] = len(sent), i in resume.finish_reasons
                output_ids[i] += sent
                _chat_deltas(parsers[i], CompletionOutput(i, (shown or {}).get(i, ""), sent), thinkers[i])
        item = StreamItem("")
        async for out in chain(first, gen):
            for comp in out.outputs:
                i = comp.index
                if finished[i]:
                    continue
                num_tokens[i] += len(comp.token_ids)
                output_ids[i] += comp.token_ids
                item.token_ids.setdefault(i, []).extend(comp.token_ids)
                deltas = _chat_deltas(parsers[i], comp, thinkers[i])
                logprobs = chat_logprobs(comp, params.logprobs)
                if logprobs is not None and not deltas:
                    deltas = [ChatDelta(content="")]
                for j, delta in enumerate(deltas):
                    events.append(chunk(i, delta, logprobs if j == 0 else None))
                if comp.finished:
                    finished[i] = True
                    item.finish_reasons[i] = comp.finish_reason
                    calls = parsers[i] is not None and parsers[i].num_calls > 0
                    reason = (
                        plan.finish_reason if calls and comp.finish_reason == "stop" else comp.finish_reason
                    )
                    events.append(chunk(i, ChatDelta(), finish_reason=reason))
            if events and not all(finished):  # the last events go out with the closing ones
                item.text = "".join(events)
                yield item
                events, item = [], StreamItem("")
        if report.final:
            body = ChatCompletionChunk(
                id=response_id,
                created=created,
                model=model,
                choices=[],
                usage=usage(prompt_tokens, num_tokens, first),
            )
            if self.reasoning_parser is not None:
                count = lambda: sum(  # noqa: E731 - decodes prefixes of the output: off the loop when long
                    reasoning_tokens(t, self.tokenizer, ids)
                    for t, ids in zip(thinkers, output_ids, strict=True)
                )
                thinking = await tokenize_off_loop(count, output_ids)
                body.usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=thinking)
            events.append(sse(body))
        yield final_item("".join([*events, DONE]), [gen])


def _chat_deltas(
    parser: ToolCallStreamParser | None, comp: CompletionOutput, thinker: ReasoningParser | None = None
) -> list[ChatDelta]:
    """A choice's next deltas: its thinking (`reasoning_content`, when the pool parses it), then its
    answer, with tool calls parsed out of the answer."""
    text, deltas = comp.text, []
    if thinker is not None:
        split = thinker.feed(text)
        if comp.finished:
            rest = thinker.finish()
            split.reasoning, split.content = split.reasoning + rest.reasoning, split.content + rest.content
        if split.reasoning:
            deltas.append(ChatDelta(reasoning_content=split.reasoning))
        text = split.content
    if parser is None:
        return deltas + ([ChatDelta(content=text)] if text else [])
    events = parser.feed(text) + (parser.finish() if comp.finished else [])
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
