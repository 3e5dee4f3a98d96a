"""/v1/embeddings (computed in this replica, deployments/gateway/embeddings.py) and vLLM's /tokenize
and /detokenize (a pool's tokenizer, through admission)."""

import json

from fastapi import APIRouter, Request
from fastapi.responses import Response

from raylane.deployments.gateway.core import PROMPT_BYTES_PER_TOKEN, GatewayCore
from raylane.deployments.gateway.embeddings import create_embeddings
from raylane.deployments.gateway.openapi import route_docs
from raylane.deployments.gateway.pool_call import admitted_pool_call
from raylane.deployments.gateway.request_body import (
    off_the_loop_if_large,
    parse_bytes,
    parse_json_object,
    validate_body,
)
from raylane.deployments.protocol.openai_schemas import EmbeddingRequest, EmbeddingResponse
from raylane.deployments.protocol.tokenization_schemas import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    tokenize_request_model,
)
from raylane.router import Principal, RateCharge

router = APIRouter()


class EmbeddingsRoutes(GatewayCore):
    @router.post("/v1/embeddings", **route_docs(EmbeddingResponse, EmbeddingRequest))
    async def embeddings(self, request: Request) -> Response:
        principal = self.authenticate(request)  # MiniLM runs here: keyed like every other endpoint
        body = await self.read_charged(request, principal)  # its tokens estimated, before parsing
        return await self.serve_embeddings(principal, body, request.state.rate_charge)

    async def serve_embeddings(self, principal: Principal, body: bytes, charge: RateCharge) -> Response:
        response, _ = await self.embed(principal, body, charge)
        return Response(response, media_type="application/json")

    async def embed(
        self, principal: Principal, body: bytes, charge: RateCharge, max_bytes: int | None = None
    ) -> tuple[str, int]:
        """An embeddings request's JSON answer and the tokens MiniLM read (its usage)."""
        req = await parse_bytes(body, EmbeddingRequest)
        response, tokens = await create_embeddings(self.config.embeddings, req, principal.key_id, max_bytes)
        # MiniLM's tokenizer reads every byte though the model reads only 256 tokens of an input:
        # settled with its count, never below the body's estimate.
        estimate = len(body) // PROMPT_BYTES_PER_TOKEN
        charge.settle(max(tokens, estimate))
        return response, tokens

    @router.post(
        "/tokenize", **route_docs(TokenizeResponse, (TokenizeChatRequest, TokenizeCompletionRequest))
    )
    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: `prompt`, or `messages` through the chat template, counted by the pool
        that `model` names (its tokenizer, its `max_model_len`)."""
        principal = self.authenticate(request)
        # The pool's template and tokenizer work grows with the text: its tokens are charged first.
        body = await self.read_charged(request, principal)
        charge = request.state.rate_charge
        data = await off_the_loop_if_large(body, lambda: parse_json_object(body))
        req = validate_body(data, tokenize_request_model(data))
        messages = [m.model_dump(exclude_none=True) for m in getattr(req, "messages", [])]
        call = lambda pool: pool.tokenize.remote(req)  # noqa: E731
        response = await admitted_pool_call(
            self.router, self.pools, principal, charge, req.model, messages, call
        )
        charge.settle(json.loads(response.body)["count"])
        return response

    @router.post("/detokenize", **route_docs(DetokenizeResponse, DetokenizeRequest))
    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize, charged as many tokens as it decodes and admitted like generation."""
        principal = self.authenticate(request)
        body = await self.read_charged(request, principal)
        charge = request.state.rate_charge
        data = await off_the_loop_if_large(body, lambda: parse_json_object(body))
        req = validate_body(data, DetokenizeRequest)
        self.router.charge_more(principal, charge, len(req.tokens))  # 429 when the key cannot cover them
        call = lambda pool: pool.detokenize.remote(req)  # noqa: E731
        response = await admitted_pool_call(self.router, self.pools, principal, charge, req.model, [], call)
        charge.settle(len(req.tokens))
        return response
