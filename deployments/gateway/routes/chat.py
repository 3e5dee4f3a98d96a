"""OpenAI's /v1/chat/completions and /v1/completions: parsed, charged and resolved here, dispatched
to the route's pools by the `Dispatcher`."""

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response

from raylane.deployments.gateway.affinity import ConversationAffinity
from raylane.deployments.gateway.core import GatewayCore
from raylane.deployments.gateway.openapi import route_docs
from raylane.deployments.gateway.request_body import parse_bytes
from raylane.deployments.gateway.request_record import router_timed
from raylane.deployments.protocol.errors import invalid
from raylane.deployments.protocol.openai_schemas import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
)
from raylane.deployments.protocol.sampling import chat_params, completion_params
from raylane.deployments.protocol.wire import PoolRequest
from raylane.router import Principal, RateCharge

router = APIRouter()


class ChatRoutes(GatewayCore):
    affinity: ConversationAffinity

    @router.post(
        "/v1/chat/completions", **route_docs(ChatCompletion, ChatCompletionRequest, ChatCompletionChunk)
    )
    async def chat_completions(self, request: Request) -> Response:
        principal = self.authenticate(request)
        body = await self.read_charged(request, principal)  # the rate limit, before any parsing
        return await self.serve_chat(principal, body, request.state.rate_charge)

    async def serve_chat(self, principal: Principal, body: bytes, charge: RateCharge) -> Response:
        req = await parse_bytes(body, ChatCompletionRequest)
        self.charge_output(principal, charge, req.max_output_tokens, req.n)
        params, tools = await self.prepare(chat_params, req, principal)
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        resolution, conversation = await router_timed(
            self.affinity.resolve(self.router, principal, req.model, messages, req.prompt_cache_key)
        )
        pool_request = PoolRequest("chat", req, params, uuid.uuid4().hex, tools=tools)
        response = await self.dispatcher.dispatch(
            principal, resolution, pool_request, req.n, bool(req.stream), charge
        )
        self.affinity.served(conversation, resolution, response)  # later turns of `auto` stay on its pool
        return response

    @router.post("/v1/completions", **route_docs(Completion, CompletionRequest, Completion))
    async def completions(self, request: Request) -> Response:
        principal = self.authenticate(request)
        body = await self.read_charged(request, principal)  # the rate limit, before any parsing
        return await self.serve_completions(principal, body, request.state.rate_charge)

    async def serve_completions(self, principal: Principal, body: bytes, charge: RateCharge) -> Response:
        req = await parse_bytes(body, CompletionRequest)
        self.check_batch(len(req.prompts()))
        self.charge_output(principal, charge, req.max_output_tokens, req.n * len(req.prompts()))
        params = await self.prepare(completion_params, req, principal)
        texts = [p for p in req.prompts() if isinstance(p, str)]
        resolution = await router_timed(
            self.router.resolve_async(req.model, [{"role": "user", "content": t} for t in texts])
        )
        pool_request = PoolRequest("completions", req, params, uuid.uuid4().hex)
        return await self.dispatcher.dispatch(
            principal, resolution, pool_request, req.n, bool(req.stream), charge
        )

    def check_batch(self, prompts: int) -> None:
        """Each prompt of a batch is its own engine request (n of them with `n`): bounded, so that one
        HTTP request cannot queue thousands of sequences."""
        limit = self.config.gateway.max_batch_prompts
        if prompts > limit:
            raise invalid("prompt", f"A batch may hold at most {limit} prompts, got {prompts}.")
