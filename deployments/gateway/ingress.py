"""The OpenAI-compatible ingress (FastAPI on Ray Serve): the endpoints.

Per request: authenticate the API key (-> tier; 401), read the body's bytes (413 past the limit),
charge the tier's rate limit (429) one request and the prompt's estimate from the byte count before
any work whose cost the client controls, parse and validate the body (any mistake -> 400 naming the
parameter), charge max_tokens x n (429), resolve `model` with the router (a pool's name or served
id, or `auto` / `raylane-auto` -> the semantic classifier's route; 404), then hand it to the
`Dispatcher` (deployments/gateway/dispatch.py): a slot in the first pool of the route's fallback chain that
can serve, the pool's first item, fallback before it and relay after it. The charge is settled with
the tokens used when the response ends; a request refused on the way is settled with none.
Responses carry `x-raylane-route`, `-pool`, `-tier` and, where they apply, `-fallback`,
`-decision` and `-adapter`.
When the client goes away, the pool call is cancelled; the pool's generator aborts the engine
request. `PoolHealth` (deployments/gateway/pool_health.py) checks each pool in the background; embeddings
are computed here (deployments/gateway/embeddings.py). While the app drains before shutdown
(deployments/gateway/drain.py), new requests get 503 with Retry-After and /health says "draining"; the
requests in flight finish.
"""

import asyncio
import json
import logging
import os
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from raylane import tracing
from raylane.bounded_worker import BoundedWorker, WorkerBusy, WorkerStarved, WorkerTimeout, start_forkserver
from raylane.config import ClusterConfig
from raylane.config.batch import BATCH_TIER, batch_tier
from raylane.deployments import live_config
from raylane.deployments.batch.service import may_hold_batches
from raylane.deployments.gateway.affinity import ConversationAffinity
from raylane.deployments.gateway.batch_api import BatchApi, list_limit, owner, page
from raylane.deployments.gateway.dispatch import Dispatcher, error_response
from raylane.deployments.gateway.drain import RETRY_AFTER_S, DrainWatcher
from raylane.deployments.gateway.embeddings import EMBEDDINGS_PRELOAD, ResultTooLarge, create_embeddings
from raylane.deployments.gateway.lora_adapters import LoRAAdapters
from raylane.deployments.gateway.openapi import publish, route_docs
from raylane.deployments.gateway.pool_call import admitted_pool_call
from raylane.deployments.gateway.pool_health import PoolHealth, pool_deployment_name, serve_liveness
from raylane.deployments.gateway.request_body import (
    off_the_loop_if_large,
    parse_body,
    parse_bytes,
    parse_json_object,
    read_body,
    return_large_buffers,
    validate_body,
)
from raylane.deployments.gateway.request_log import RequestLogMiddleware, current_record, router_timed
from raylane.deployments.gateway.response_store import response_store
from raylane.deployments.gateway.responses_api import StoredResponses
from raylane.deployments.gateway.routing import build_router, classifier_for, update_router
from raylane.deployments.metrics.gateway import render_cluster_metrics, set_config_generation
from raylane.deployments.protocol.batch_answers import (
    NO_USAGE,
    LineUsage,
    batch_budget_exceeded,
    batch_key_refused,
    line_too_large,
    usage_of,
)
from raylane.deployments.protocol.batch_schemas import (
    Batch,
    BatchCreateRequest,
    BatchList,
    FileDeleted,
    FileList,
    FileObject,
)
from raylane.deployments.protocol.errors import (
    OpenAIError,
    client_error,
    internal_error,
    invalid,
    model_not_found,
    unavailable,
)
from raylane.deployments.protocol.lora_schemas import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from raylane.deployments.protocol.openai_schemas import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    EmbeddingRequest,
    EmbeddingResponse,
    ModelCard,
    ModelList,
)
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
from raylane.deployments.protocol.sampling import chat_params, completion_params, grammar_param
from raylane.deployments.protocol.tokenization_schemas import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    tokenize_request_model,
)
from raylane.deployments.protocol.wire import PoolRequest
from raylane.router import Principal, RateCharge, RouterError
from raylane.router.errors import OverloadedError, RateLimitError

logger = logging.getLogger(__name__)
# The Gateway method that serves each endpoint a batch line may name (config.batch.BATCH_ENDPOINTS).
BATCH_SERVERS = {
    "/v1/chat/completions": "serve_chat",
    "/v1/completions": "serve_completions",
    "/v1/embeddings": "serve_embeddings",
    "/v1/responses": "serve_responses",
}
# What the gateway's grammar-check workers import (deployments/protocol/sampling.py builds the grammars,
# xgrammar checks them): the gateway process itself imports neither xgrammar nor torch.
GRAMMAR_PRELOAD = ("raylane.deployments.protocol.sampling", "xgrammar")
# The prompt's token estimate charged before the body is parsed: JSON text runs about four bytes a
# token in the tokenizers raylane serves; settled with the real count when the request ends.
PROMPT_BYTES_PER_TOKEN = 4

app = FastAPI(title="raylane", description="OpenAI-compatible API of a raylane cluster", docs_url=None)
app.add_middleware(RequestLogMiddleware)  # x-request-id, one JSON log line and HTTP metrics per request
publish(app)  # the request and response bodies in /openapi.json (the handlers parse bodies themselves)


class Draining(OpenAIError):
    def __init__(self) -> None:
        super().__init__(
            "The server is shutting down and takes no new requests; retry shortly.",
            status=503,
            code="draining",
        )


def _settle(request: Request, status: int) -> None:
    """A request answered with an error before it was served settles its up-front token charge as
    a pool's error does (`RateCharge.settle_error`): the client's own 4xx keeps the part charged for
    the body's bytes, which the gateway read and parsed; a 429 or a 5xx gives all back. (Refunded in
    full, a key could send invalid 200 KB bodies at any rate and never meet its tokens/min.)"""
    charge = getattr(request.state, "rate_charge", None)
    if charge is not None:
        charge.settle_error(status)


@app.exception_handler(OpenAIError)
async def _openai_error(request: Request, error: OpenAIError) -> JSONResponse:
    _settle(request, error.status)
    headers = {"retry-after": str(RETRY_AFTER_S)} if isinstance(error, Draining) else None
    return error_response(error, headers)


@app.exception_handler(RouterError)
async def _router_error(request: Request, error: RouterError) -> JSONResponse:
    _settle(request, error.status)
    return JSONResponse(error.to_openai(), status_code=error.status, headers=error.headers())


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
    return error_response(OpenAIError(str(error.detail), status=error.status_code, code=code))


@app.exception_handler(Exception)
async def _unexpected(request: Request, error: Exception) -> JSONResponse:
    _settle(request, 500)
    logger.exception("unhandled error in the gateway")
    return error_response(internal_error())


# Module helpers come before the class: `serve.ingress` serializes the app's routes when the class is
# decorated, and names defined after that point would be missing in the replica.


@serve.ingress(app)
class Gateway:
    def __init__(self, config: ClusterConfig | dict[str, Any], pools: dict[str, Any]):
        self.config = ClusterConfig.model_validate(config)
        context = serve.get_replica_context()
        # Traces of requests, when `observability.tracing` (or OTEL_*) names an endpoint. Set once per
        # process: a change reaches replicas started after it.
        tracing.configure(
            self.config.observability.tracing.model_dump(), f"gateway:{context.replica_id.unique_id}"
        )
        # The handles were made where the app was built; calls go by gRPC when this replica's Serve
        # runs with it (cluster/serve_env.py), as the proxy's calls to this replica do.
        grpc = os.environ.get("RAY_SERVE_USE_GRPC_BY_DEFAULT") == "1"
        # (A pool being removed by `raylane apply` is still deployed, with a handle here: not served.)
        names = {p.name for p in self.config.pools}
        self.pools = {n: h.options(_by_reference=not grpc) for n, h in pools.items() if n in names}
        self.created = int(time.time())
        return_large_buffers()
        self.lora = LoRAAdapters(context.app_name, self.config, self._adapters_changed)
        self.lora.loaded = self.lora.read()  # those loaded at run time before this replica started
        # (logs loudly when no API key is configured: open mode)
        self.router = build_router(self.config, self.lora.by_pool())
        # What its workers import, now rather than for the first request that needs one.
        start_forkserver(GRAMMAR_PRELOAD + (EMBEDDINGS_PRELOAD if self.config.embeddings.enabled else ()))
        self.grammar_worker: BoundedWorker | None = None  # started by the first request with a grammar
        self.drain = DrainWatcher(context.app_name, context.replica_id.unique_id)
        period_s, alive = self.config.gateway.pool_health_period_s, serve_liveness(context.app_name)
        self.pool_health = PoolHealth(self.pools, self.router, period_s, alive)
        self.dispatcher = Dispatcher(
            self.config, self.router, self.pools, self.pool_health, self.drain, self.lora
        )
        self._stored_responses: StoredResponses | None = None
        self.affinity = ConversationAffinity(self.config.router.affinity)
        self.built_config = self.config  # what the app was built with, before any user config
        self.config_generation: int | None = None  # set by `reconfigure` when the app is live-configurable
        self.config_digest: str | None = None
        self._reconfiguring = asyncio.Lock()
        self.batch_api = BatchApi(context.app_name, self.config)
        if self.config.batch.enabled and may_hold_batches(context.app_name, self.config.batch):
            self.batch_api.start()  # batches an earlier run left are taken up now

    async def reconfigure(self, user_config: dict) -> None:
        """Serve calls this when the app's gateway user config changes (`raylane apply`, or an edit
        of a manifest's serveConfigV2), and once after `__init__`: take the config it names
        (deployments/live_config.py), or the sections it carries (cluster/k8s.py), in place.
        Requests in flight keep their slots, charges and pool calls; keys' rate-limit spending,
        circuit breakers and affinities carry over; pools added get a handle, pools removed get no
        new requests."""
        async with self._reconfiguring:
            context = serve.get_replica_context()
            app_name = context.app_name
            if "sections" in user_config:
                source = "the Gateway deployment's user_config"
                config = self.built_config.with_sections(user_config["sections"], source)
                if config != self.config:
                    await self._take(config, app_name)
                    logger.info("gateway sections of the user config applied in place")
                return
            generation, digest = user_config["config_generation"], user_config["config_digest"]
            if self.config_digest is None and digest == live_config.config_digest(self.config):
                self.config_digest = digest  # the config it was started with
            if digest != self.config_digest:
                await self._take(await asyncio.to_thread(live_config.load, app_name, digest), app_name)
                logger.info("config generation %d applied in place", generation)
            self.config_generation, self.config_digest = generation, digest
            set_config_generation(generation)
            ack = live_config.acknowledge
            await asyncio.to_thread(ack, app_name, context.replica_id.unique_id, generation)

    async def _take(self, config: ClusterConfig, app_name: str) -> None:
        """Switch this replica to `config`: the router (a changed route's classifier is trained off
        the loop, seconds), the pools' handles, the settings."""
        classifier = await asyncio.to_thread(classifier_for, self.router, config)
        self.lora.config = config
        update_router(self.router, config, classifier, self.lora.by_pool())
        grpc = os.environ.get("RAY_SERVE_USE_GRPC_BY_DEFAULT") == "1"
        for pool in config.pools:
            if pool.name not in self.pools:
                handle = serve.get_deployment_handle(pool_deployment_name(pool.name), app_name)
                self.pools[pool.name] = handle.options(_by_reference=not grpc)
        for name in set(self.pools) - {p.name for p in config.pools}:
            del self.pools[name]  # the health loop stops probing it; requests on it finish there
        if config.router.affinity != self.config.router.affinity:
            self.affinity = ConversationAffinity(config.router.affinity)
        self.pool_health.period_s = config.gateway.pool_health_period_s
        if self.grammar_worker is not None:  # each call reads the bound: the same worker takes it
            self.grammar_worker.timeout_s = config.gateway.grammar_check_timeout_s
        self.config = self.dispatcher.config = self.batch_api.config = config

    # -- endpoints --------------------------------------------------------------------------------

    @app.post(
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

    @app.post("/v1/completions", **route_docs(Completion, CompletionRequest, Completion))
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

    @app.post("/v1/embeddings", **route_docs(EmbeddingResponse, EmbeddingRequest))
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

    @app.post("/tokenize", **route_docs(TokenizeResponse, (TokenizeChatRequest, TokenizeCompletionRequest)))
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

    @app.post("/detokenize", **route_docs(DetokenizeResponse, DetokenizeRequest))
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

    @app.post("/v1/responses", **route_docs(ResponseObject, ResponsesRequest, ResponseStreamEvent))
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

    @app.get("/v1/responses/{response_id}", **route_docs(ResponseObject))
    async def retrieve_response(self, response_id: str, request: Request) -> Response:
        record = await self.stored_responses.record(response_id, self.authenticate(request))
        return JSONResponse(record["response"])

    @app.delete("/v1/responses/{response_id}", **route_docs(ResponseDeleted))
    async def delete_response(self, response_id: str, request: Request) -> Response:
        return await self.stored_responses.delete(response_id, self.authenticate(request))

    # -- the Batch API: records and runs in the app's batch actor (deployments/batch/) --------------

    @app.post("/v1/files", **route_docs(FileObject))
    async def create_file(self, request: Request) -> Response:
        """Upload a batch's input file (multipart/form-data: `file`, `purpose` = batch)."""
        principal = self.authenticate(request)
        self.router.check_rate(principal)  # one request; the lines' tokens are the batch tier's
        return JSONResponse(await self.batch.upload(request, principal))

    @app.get("/v1/files", **route_docs(FileList))
    async def list_files(self, request: Request) -> Response:
        principal = self.authenticate(request)
        limit = list_limit(request, 10_000, 10_000)
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise invalid("order", "order must be 'asc' or 'desc'.")
        args = (request.query_params.get("purpose"), limit + 1, request.query_params.get("after"), order)
        return JSONResponse(page(await self.batch.call("files", owner(principal), *args), limit))

    @app.get("/v1/files/{file_id}", **route_docs(FileObject))
    async def retrieve_file(self, file_id: str, request: Request) -> Response:
        return JSONResponse(await self.batch.call("file", owner(self.authenticate(request)), file_id))

    @app.get("/v1/files/{file_id}/content")
    async def file_content(self, file_id: str, request: Request) -> Response:
        return await self.batch.content(self.authenticate(request), file_id)  # streamed in pages

    @app.delete("/v1/files/{file_id}", **route_docs(FileDeleted))
    async def delete_file(self, file_id: str, request: Request) -> Response:
        return JSONResponse(await self.batch.call("delete_file", owner(self.authenticate(request)), file_id))

    @app.post("/v1/batches", **route_docs(Batch, BatchCreateRequest))
    async def create_batch(self, request: Request) -> Response:
        principal = self.authenticate(request)
        self.router.check_rate(principal)
        body = await read_body(request, self.config.gateway.max_request_body_bytes)
        return JSONResponse(await self.batch.create_batch(body, principal))

    @app.get("/v1/batches", **route_docs(BatchList))
    async def list_batches(self, request: Request) -> Response:
        principal = self.authenticate(request)
        limit = list_limit(request, 20, 100)
        args = (owner(principal), limit + 1, request.query_params.get("after"))
        return JSONResponse(page(await self.batch.call("batches", *args), limit))

    @app.get("/v1/batches/{batch_id}", **route_docs(Batch))
    async def retrieve_batch(self, batch_id: str, request: Request) -> Response:
        return JSONResponse(await self.batch.call("batch", owner(self.authenticate(request)), batch_id))

    @app.post("/v1/batches/{batch_id}/cancel", **route_docs(Batch))
    async def cancel_batch(self, batch_id: str, request: Request) -> Response:
        return JSONResponse(
            await self.batch.call("cancel_batch", owner(self.authenticate(request)), batch_id)
        )

    # -- LoRA adapters loaded at run time (deployments/gateway/lora_adapters.py) ----------------------

    @app.post("/v1/load_lora_adapter", **route_docs(None, LoadLoRAAdapterRequest))
    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's: serve a PEFT adapter on a pool from now on, through every gateway replica. A
        replica of the pool checks it first (its files, rank and shapes against the pool's model),
        so a bad adapter is this call's 400, never a failed request later."""
        req = await self.admin_body(request, LoadLoRAAdapterRequest)
        pool, name = self.lora.target(req.pool, req.lora_name)
        roots = self.config.gateway.lora_adapter_roots
        if not roots:
            raise invalid(
                "lora_path", "No directory is open to run-time loads: set gateway.lora_adapter_roots."
            )
        checked = await self.call_pool(
            pool, [], lambda handle: handle.check_adapter.remote(req.lora_path, roots)
        )
        path = json.loads(checked.body)["path"]  # resolved where the files are
        await self.lora.load(pool, name, path, req.load_inplace)
        logger.info("LoRA adapter %s loaded on pool %s from %s", name, pool, path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", **route_docs(None, UnloadLoRAAdapterRequest))
    async def unload_lora_adapter(self, request: Request) -> Response:
        """vLLM's: stop serving an adapter loaded at run time (requests running with it finish)."""
        req = await self.admin_body(request, UnloadLoRAAdapterRequest)
        pool, name = self.lora.target(req.pool, req.lora_name)
        await self.lora.unload(pool, name)
        logger.info("LoRA adapter %s unloaded from pool %s", name, pool)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def admin_body(self, request: Request, model):
        """The body of an adapter change, once the caller is found to be allowed one: a key of an
        `admin` tier, or anyone in open mode with `gateway.allow_runtime_lora_updating`."""
        principal = self.authenticate(request)
        self.router.check_rate(principal)
        if self.router.open_mode and not self.config.gateway.allow_runtime_lora_updating:
            raise OpenAIError(
                "Loading LoRA adapters at run time is off: configure API keys with an `admin` tier, or "
                "set gateway.allow_runtime_lora_updating (open mode).",
                status=403,
                code="permission_denied",
            )
        if not self.router.open_mode and not principal.tier.admin:
            raise OpenAIError(
                f"Only keys of an `admin` tier may load or unload LoRA adapters; this key's tier is "
                f"'{principal.tier.name}'.",
                status=403,
                code="permission_denied",
            )
        return await parse_body(request, model, self.config.gateway.max_request_body_bytes)

    def _adapters_changed(self) -> None:
        update_router(self.router, self.config, self.router.classifier, self.lora.by_pool())

    async def run_batch_line(
        self, key_id: str, endpoint: str, body: bytes, check_key: bool = True, trace: dict | None = None
    ) -> tuple[int, str, bool, LineUsage]:
        """One line of a batch (called by the batch actor), served as a request of the `batch` tier
        from the key that made the batch: (status, JSON body, whether other tiers were using its pool,
        its usage).
        `check_key`: the key must still be known and its tier allow batches (else a 403 that stops the
        batch: `raylane batch run`, an operator's job, names no key); its tier's
        `batch_tokens_per_minute` is charged (past it, a 429 the batch waits out). `trace`: the
        batch's span's carrier: the line is traced as its child."""
        span = tracing.start(f"batch line {endpoint}", parent=trace, kind="server") if trace else None
        token, status = tracing.attach(span), 500
        try:
            answer = await self._run_batch_line(key_id, endpoint, body, check_key)
            status = answer[0]
            return answer
        finally:
            tracing.detach(token)
            tracing.end(
                span, error="failed" if status >= 500 else None, **{"http.response.status_code": status}
            )

    async def _run_batch_line(
        self, key_id: str, endpoint: str, body: bytes, check_key: bool
    ) -> tuple[int, str, bool, LineUsage]:
        key_tier = self.router.tier_of_key(key_id) if check_key else None
        if check_key and (key_tier is None or not key_tier.batches):
            return 403, json.dumps(batch_key_refused(key_tier).to_dict()), False, NO_USAGE
        principal = Principal(key_id, batch_tier(list(self.config.tiers), self.config.batch, key_tier))
        charge = None
        busy = True
        try:
            self.check_open()
            charge = self.router.check_rate(principal, len(body) // PROMPT_BYTES_PER_TOKEN)
            if endpoint == "/v1/embeddings":  # stops computing once past the line's cap
                max_bytes = self.config.batch.max_line_result_bytes
                result, tokens = await self.embed(principal, body, charge, max_bytes)
                status, pool, usage = 200, None, LineUsage(tokens)
            else:
                response = await getattr(self, BATCH_SERVERS[endpoint])(principal, body, charge)
                status, pool = response.status_code, response.headers.get("x-raylane-pool")
                result, usage = bytes(response.body).decode(), usage_of(response.body)
            # Busy: interactive requests are on the pool (or anything waits): the batch steps back. A
            # line computed here (embeddings) shares this replica's CPU with every pool's requests.
            pools = [pool] if pool is not None else [p.name for p in self.config.pools]
            busy = any(self.router.others_on(p, BATCH_TIER) for p in pools)
            if (size := len(result.encode())) > self.config.batch.max_line_result_bytes:  # never shipped
                return 413, json.dumps(line_too_large(size, self.config.batch).to_dict()), busy, NO_USAGE
            return status, result, busy, usage
        except ResultTooLarge as e:
            charge.settle(max(e.tokens, len(body) // PROMPT_BYTES_PER_TOKEN))  # computed, then dropped
            error = line_too_large(e.size, self.config.batch, at_least=True)
            return 413, json.dumps(error.to_dict()), busy, NO_USAGE
        except RateLimitError as e:  # the batch tier has only the key's batch tokens/min
            return 429, json.dumps(batch_budget_exceeded(e).to_dict()), busy, NO_USAGE
        except OpenAIError as e:
            return e.status, json.dumps(e.to_dict()), busy, NO_USAGE
        except RouterError as e:
            return e.status, json.dumps(e.to_openai()), busy, NO_USAGE
        except Exception:
            logger.exception("a batch line failed in the gateway")
            return 500, json.dumps(internal_error().to_dict()), busy, NO_USAGE
        finally:
            if charge is not None:
                charge.settle(0)

    @property
    def batch(self) -> BatchApi:
        if not self.config.batch.enabled:
            raise OpenAIError(
                "The Batch API is off on this cluster (batch.enabled).", status=404, code="not_found"
            )
        return self.batch_api

    @app.get("/v1/models", **route_docs(ModelList))
    async def list_models(self, request: Request) -> Response:
        self.authenticate(request)
        return Response(ModelList(data=self.model_cards()).to_json(), media_type="application/json")

    @app.get("/v1/models/{model_id:path}", **route_docs(ModelCard))
    async def retrieve_model(self, model_id: str, request: Request) -> Response:
        self.authenticate(request)
        card = next((c for c in self.model_cards() if c.id == model_id), None)
        if card is None:
            raise model_not_found(model_id)
        return Response(card.to_json(), media_type="application/json")

    async def check_health(self) -> None:
        """Serve's periodic replica check, on the replica's event loop: it starts the drain watcher of
        a replica that has served nothing yet, so a drain need not wait its whole timeout for it."""
        self.drain.start()

    @app.get("/health")
    async def health(self, request: Request) -> JSONResponse:
        """200 while every pool is up (`ok`, or `busy`: alive, too loaded to answer its probe in
        time), 503 naming the pools that are down. From the health loop's last check, so a call costs
        no round trip to the pools. With API keys configured, a caller without a valid key learns
        only the status; with one, each pool's load and this gateway replica's `router` view too."""
        self.pool_health.watch()
        self.drain.start()
        pools = await self.pool_health.current()
        healthy = all(p["status"] != "unavailable" for p in pools.values())
        status = "draining" if self.drain.draining else "ok" if healthy else "degraded"
        code = 200 if status == "ok" else 503
        if not self.may_see_internals(request):
            return JSONResponse({"status": status}, code)
        body = {
            "status": status,
            "pools": pools,
            "router": self.pool_health.router_state(),
            "gateway": {"in_flight": self.drain.in_flight, "asyncio_tasks": len(asyncio.all_tasks())},
        }
        return JSONResponse(body, code)

    @app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        """Prometheus text format, aggregated over every gateway and pool replica of the app (behind an
        API key when `gateway.metrics_require_key`)."""
        from prometheus_client import CONTENT_TYPE_LATEST

        if self.config.gateway.metrics_require_key:
            self.router.authenticate(request.headers)
        return Response(await render_cluster_metrics(), media_type=CONTENT_TYPE_LATEST)

    # -- helpers ----------------------------------------------------------------------------------

    async def read_charged(self, request: Request, principal: Principal) -> bytes:
        """The body's bytes (413 past the limit), charged to the key's rate limit before anything
        reads them: one request and the prompt's estimate, `PROMPT_BYTES_PER_TOKEN` bytes a token
        (429 when over it). A body with a Content-Length is charged on it before a byte is read, so
        a key that cannot afford its body, or is over its limit already, costs this replica a
        look-up (Serve's proxy then never forwards the body either); a chunked body is charged once
        read, within the byte limit."""
        max_bytes = self.config.gateway.max_request_body_bytes
        declared = request.headers.get("content-length", "")
        charged_first = declared.isdigit() and int(declared) <= max_bytes  # (HTTP/1.1 framing holds it)
        with tracing.span("gateway.rate_limit"):
            self.router.precheck_rate(principal)  # a key over its limits: 429 without reading its body
            if charged_first:
                charge = self.router.check_rate(principal, int(declared) // PROMPT_BYTES_PER_TOKEN)
                request.state.rate_charge = charge
        with tracing.span("gateway.read_body") as span:
            body = await read_body(request, max_bytes)
            tracing.set_attributes(span, **{"http.request.body.size": len(body)})
        if not charged_first:
            with tracing.span("gateway.rate_limit"):
                charge = self.router.check_rate(principal, len(body) // PROMPT_BYTES_PER_TOKEN)
                request.state.rate_charge = charge
        return body

    def charge_output(self, principal: Principal, charge: RateCharge, max_tokens: int | None, n: int) -> None:
        """Charge what the request may generate, `max_tokens` x `n` (`router.max_tokens_estimate` a
        choice without max_tokens), up front; 429 when the key's tokens/min cannot cover it."""
        per_choice = max_tokens if max_tokens is not None else self.config.router.max_tokens_estimate
        self.router.charge_more(principal, charge, per_choice * n)

    def check_batch(self, prompts: int) -> None:
        """Each prompt of a batch is its own engine request (n of them with `n`): bounded, so that one
        HTTP request cannot queue thousands of sequences."""
        limit = self.config.gateway.max_batch_prompts
        if prompts > limit:
            raise invalid("prompt", f"A batch may hold at most {limit} prompts, got {prompts}.")

    async def prepare(self, fn, req, principal: Principal):
        """`fn(req)`: the request's sampling parameters. With a grammar (a schema, regex, EBNF, tool
        definitions) the checks and builds that can take exponential time run in a bounded worker
        process: past `gateway.grammar_check_timeout_s` the request gets a 400 naming the field and this event
        loop never waited on it; when the worker's queue, or the key's share of it, is full, a 429
        with Retry-After at once, and the same when the machine was too busy to give the check its
        time (WorkerStarved). Without one, here (microseconds)."""
        param = grammar_param(req)
        if param is None:
            return fn(req)
        if self.grammar_worker is None:
            self.grammar_worker = BoundedWorker(
                timeout_s=self.config.gateway.grammar_check_timeout_s, preload=GRAMMAR_PRELOAD
            )
        try:
            with tracing.span("gateway.grammar_check", **{"raylane.grammar_param": param}):
                return await self.grammar_worker.run(fn, req, key=principal.key_id)
        except WorkerBusy as e:
            raise OverloadedError(
                f"The grammar in '{param}' cannot be checked now: {e}. Retry later, or send fewer at once.",
                retry_after=e.retry_after,
                reason="grammar_starved" if isinstance(e, WorkerStarved) else "grammar_queue",
            ) from None
        except WorkerTimeout as e:
            raise invalid(
                param,
                f"Invalid '{param}': too complex: checking it was stopped, {e}. Simplify the schema, "
                "regex or grammar (nesting, alternatives, repetition counts).",
                code="grammar_too_complex",
            ) from None

    async def call_pool(self, model: str, messages: list[dict], call) -> Response:
        """An admin's call (an adapter's check) to the pool `model` resolves to, whose JSON answer is
        the response; a client mistake the pool found is its 4xx."""
        resolution = await router_timed(self.router.resolve_async(model, messages))
        pool = resolution.pools[0]
        try:
            body = await call(self.pools[pool])
        except Exception as e:
            if (error := client_error(e)) is not None:
                raise error from None
            logger.warning("pool %s failed a %s request: %s", pool, "tokenize", e)
            raise unavailable(f"The pool {pool} could not answer: {type(e).__name__}.") from None
        return Response(body, media_type="application/json", headers={"x-raylane-pool": pool})

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

    def model_cards(self) -> list[ModelCard]:
        cards = [ModelCard(id=p.model_id, created=self.created) for p in self.config.pools]
        listed = {p.name for p in self.config.pools} | {c.id for c in cards}
        adapters = self.lora.by_pool()
        for pool in self.config.pools:  # an adapter by its own name, or `<pool>:<name>` where that is taken
            for name in adapters[pool.name]:
                model = name if name not in listed else f"{pool.name}:{name}"
                listed.add(model)
                cards.append(ModelCard(id=model, created=self.created, parent=pool.model_id))
        if self.config.embeddings.enabled:
            cards.append(ModelCard(id=self.config.embeddings.model_id, created=self.created))
        return cards

    def check_open(self) -> None:
        self.pool_health.watch()
        self.lora.watch()
        self.drain.start()
        if self.drain.draining:
            raise Draining()

    def may_see_internals(self, request: Request) -> bool:
        """Open mode, or a valid API key: /health's details (pool names, loads) are for callers."""
        try:
            self.router.authenticate(request.headers)
        except RouterError:
            return False
        return True

    def authenticate(self, request: Request) -> Principal:
        self.check_open()
        if (record := current_record()) is not None:
            record.config_generation = self.config_generation
        with tracing.span("gateway.authenticate") as span:
            principal = self.router.authenticate(
                request.headers, request.client.host if request.client else None
            )
            # The key's id ("key-<digest prefix>"), never the key.
            attributes = {"raylane.tier": principal.tier.name, "raylane.api_key.id": principal.key_id}
            tracing.set_attributes(span, **attributes)
        return principal
