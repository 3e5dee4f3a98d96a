"""`/v1/responses` on one engine: the chat request the gateway made of it, served by the pool's chat
serving (template, tool grammar, structured output, engine), its output written as a Responses
object or its typed events (deployments/pool/response_builder.py). A stream's items carry the token ids
whose text they hold (`StreamItem`), so the gateway can resume it on another replica when this one
dies (deployments/gateway/resumption.py), as it does chat streams."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from raylane.deployments.pool.response_builder import ResponseBuilder
from raylane.deployments.pool.serving import (
    chain,
    engine_failure,
    final_item,
    last,
    served_model,
)
from raylane.deployments.pool.serving_chat import OpenAIServingChat
from raylane.deployments.protocol.errors import OpenAIError
from raylane.deployments.protocol.openai_schemas import ChatCompletionRequest
from raylane.deployments.protocol.responses_request import responses_error
from raylane.deployments.protocol.sampling import ToolPlan
from raylane.deployments.protocol.wire import PoolItem, ResumeState, StreamItem
from raylane.engine import EngineDeadError, RequestOutput, SamplingParams
from raylane.engine.lora import LoRARequest


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
        resume: ResumeState | None = None,
        tenant: str = "",
        lora_request: LoRARequest | None = None,
        cache_salt: str = "",
    ) -> AsyncIterator[PoolItem]:
        """`resume`: continue a stream that a failed replica began (deployments/protocol/wire.py); `echo`
        (with the response's id and created_at) is the same for every replica that serves it."""
        chat = self.chat
        try:
            prompt_ids, engine_params, first, gen = await chat.start_chat(
                req,
                params,
                plan,
                request_id,
                "max_tokens",
                priority,
                resume,
                tenant,
                lora_request,
                cache_salt,
            )
        except OpenAIError as e:
            yield responses_error(e)
            return
        model = served_model(chat.model_id, lora_request)
        builder = ResponseBuilder(
            echo, model, plan.parse, self.reasoning_parser, chat.tokenizer, forced_tools=plan.forced
        )
        # A resumed request's cache hits may cover its earlier output too; only the prompt's count.
        prompt_tokens = len(first.prompt_token_ids)
        cached = min(first.num_cached_tokens, prompt_tokens)
        async with aclosing(gen):
            try:
                if not req.stream:
                    final = (await last(first, gen)).outputs[0]
                    builder.feed(final.text, list(final.token_ids))
                    builder.finish(final.finish_reason, prompt_tokens, cached)
                    yield final_item(json.dumps(builder.response, ensure_ascii=False), [gen])
                    return
                if resume is None:
                    events = builder.start()
                else:  # the client has the opening events and the text of the tokens sent
                    shown = chat.resumed_texts(prompt_ids, engine_params, resume, range(1)).get(0, "")
                    builder.resume(shown, resume.token_ids.get(0, []), resume.num_events)
                    events = []
                async for item in self._stream(builder, events, first, gen, prompt_tokens, cached):
                    yield item
            except EngineDeadError as e:
                yield engine_failure(e, bool(req.stream), [gen])

    async def _stream(
        self,
        builder: ResponseBuilder,
        events: list[str],
        first: RequestOutput,
        gen: AsyncIterator[RequestOutput],
        prompt_tokens: int,
        cached: int,
    ) -> AsyncIterator[PoolItem]:
        """The stream's events as `StreamItem`s, each with the token ids fed since the one before
        (text the parsers hold back goes out, with its tokens, in a later item); the last events go
        out with the closing ones in the `FinalItem`."""
        item, finish_reason = StreamItem(""), None
        async for out in chain(first, gen):
            comp = out.outputs[0]
            events += builder.feed(comp.text, list(comp.token_ids))
            item.token_ids.setdefault(0, []).extend(comp.token_ids)
            if comp.finished:
                finish_reason = comp.finish_reason
            elif events:
                item.text = "".join(events)
                yield item
                events, item = [], StreamItem("")
        events += builder.finish(finish_reason, prompt_tokens, cached)
        yield final_item("".join(events), [gen])
