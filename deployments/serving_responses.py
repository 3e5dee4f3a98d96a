"""`/v1/responses` on one engine: the chat request the gateway made of it, served by the pool's chat
serving (template, tool grammar, structured output, engine), its output written as a Responses
object or its typed events (deployments/response_builder.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from deployments.errors import OpenAIError
from deployments.openai_schemas import ChatCompletionRequest
from deployments.response_builder import ResponseBuilder
from deployments.responses_request import responses_error
from deployments.sampling import ToolPlan, grammar_param
from deployments.serving import chain, engine_failure, final_item, last
from deployments.serving_chat import OpenAIServingChat
from deployments.wire import PoolItem
from engine import EngineDeadError, RequestOutputKind, SamplingParams


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, reasoning_parser: str | None = None) -> None:
        self.chat, self.reasoning_parser = chat, reasoning_parser

    async def create(
        self,
        req: ChatCompletionRequest,
        params: SamplingParams,
        plan: ToolPlan,
        request_id: str,
        echo: dict[str, Any],
        priority: int = 0,
    ) -> AsyncIterator[PoolItem]:
        chat = self.chat
        try:
            prompt_ids = chat.render_chat(req, plan)
            chat.check_length(len(prompt_ids), params.max_tokens, "messages", "max_tokens")
            kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
            engine_params = params.clone(output_kind=kind)
            await chat._compile(engine_params, grammar_param(req))
            first, gen = await chat._start(prompt_ids, engine_params, request_id, "messages", priority)
        except OpenAIError as e:
            yield responses_error(e)
            return
        builder = ResponseBuilder(echo, chat.model_id, plan.parse, self.reasoning_parser, chat.tokenizer)
        prompt_tokens, cached = len(first.prompt_token_ids), first.num_cached_tokens
        async with aclosing(gen):
            try:
                if not req.stream:
                    final = (await last(first, gen)).outputs[0]
                    builder.feed(final.text, list(final.token_ids))
                    builder.finish(final.finish_reason, prompt_tokens, cached)
                    yield final_item(json.dumps(builder.response, ensure_ascii=False), [gen])
                    return
                events, finish_reason = builder.start(), None
                async for out in chain(first, gen):
                    comp = out.outputs[0]
                    events += builder.feed(comp.text, list(comp.token_ids))
                    if comp.finished:  # the last events go out with the closing ones
                        finish_reason = comp.finish_reason
                    elif events:
                        yield "".join(events)
                        events = []
                events += builder.finish(finish_reason, prompt_tokens, cached)
                yield final_item("".join(events), [gen])
            except EngineDeadError as e:
                yield engine_failure(e, bool(req.stream), [gen])
