"""OpenAI's Responses API: /v1/responses, and the responses stored for `previous_response_id` in the
app's response store (deployments/gateway/response_store.py)."""

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from ray import serve

from raylane.deployments.gateway.core import GatewayCore
from raylane.deployments.gateway.openapi import route_docs
from raylane.deployments.gateway.request_body import parse_bytes
from raylane.deployments.gateway.request_record import router_timed
from raylane.deployments.gateway.response_store import response_store
from raylane.deployments.gateway.responses_api import StoredResponses
from raylane.deployments.protocol.errors import OpenAIError
from raylane.deployments.protocol.responses_request import (
    check_supported,
    echo,
    new_response_id,
    responses_error,
    to_chat_request,
    to_messages,
)
from raylane.deployments.protocol.responses_schemas import (
    ResponseDeleted,
    ResponseObject,
    ResponsesRequest,
    ResponseStreamEvent,
)
from raylane.deployments.protocol.sampling import chat_params
from raylane.deployments.protocol.wire import PoolRequest
from raylane.router import Principal, RateCharge

router = APIRouter()


class ResponsesRoutes(GatewayCore):
    _stored_responses: StoredResponses | None

    @router.post("/v1/responses", **route_docs(ResponseObject, ResponsesRequest, ResponseStreamEvent))
    async def create_response(self, request: Request) -> Response:
        """OpenAI's Responses API, served as the chat request it maps to
        (deployments/protocol/responses_request.py) by the same router, tiers, admission and fallback; stored
        for `previous_response_id`."""
        principal = self.authenticate(request)
        body = await self.read_charged(request, principal)  # the rate limit, before any parsing
        return await self.serve_responses(principal, body, request.state.rate_charge)

    async def serve_responses(self, principal: Principal, body: bytes, charge: RateCharge) -> Response:
        req = await parse_bytes(body, ResponsesRequest)
        self.charge_output(principal, charge, req.max_output_tokens, 1)
        check_supported(req)
        previous = req.previous_response_id
        history = await self.stored_responses.history(previous, principal) if previous else []
        chat_req = to_chat_request(req, history)
        try:
            params, plan = await self.prepare(chat_params, chat_req, principal)
        except OpenAIError as e:
            raise responses_error(e) from None
        messages = [m.model_dump(exclude_none=True) for m in chat_req.messages]
        resolution = await router_timed(self.router.resolve_async(req.model, messages))
        echoed = echo(req, new_response_id(), previous)
        pool_request = PoolRequest("responses", chat_req, params, uuid.uuid4().hex, tools=plan, echo=echoed)
        response = await self.dispatcher.dispatch(
            principal, resolution, pool_request, 1, bool(req.stream), charge
        )
        if req.store is False:
            return response
        return await self.stored_responses.keep(response, history + to_messages(req.input), principal)

    @router.get("/v1/responses/{response_id}", **route_docs(ResponseObject))
    async def retrieve_response(self, response_id: str, request: Request) -> Response:
        record = await self.stored_responses.record(response_id, self.authenticate(request))
        return JSONResponse(record["response"])

    @router.delete("/v1/responses/{response_id}", **route_docs(ResponseDeleted))
    async def delete_response(self, response_id: str, request: Request) -> Response:
        return await self.stored_responses.delete(response_id, self.authenticate(request))

    @property
    def stored_responses(self) -> StoredResponses:
        """The app's response store, found (or created) on first use: apps that never serve
        /v1/responses start no actor."""
        if self._stored_responses is None:
            gateway = self.config.gateway
            app_name = serve.get_replica_context().app_name
            store = response_store(
                app_name,
                gateway.responses_max_stored,
                gateway.responses_ttl_s,
                gateway.responses_max_stored_per_key,
                gateway.responses_max_bytes,
                gateway.responses_max_bytes_per_key,
            )
            self._stored_responses = StoredResponses(store)
        return self._stored_responses
