"""The OpenAI-compatible ingress (FastAPI on Ray Serve).

Per request: authenticate the API key (-> tier; 401), parse and validate the body (any mistake -> 400
naming the parameter), resolve `model` with the router (a pool's name or served id, or `auto` /
`raylane-auto` -> the semantic classifier's route; 404), charge the tier's rate limit (429), take a
slot in the first pool of the route's fallback chain that can serve (waiting in (priority, arrival)
order when it is full; 429 + Retry-After past the tier's budget), and forward with `stream=True`
and the tier's priority. The pool's first item decides the response: an `OpenAIError`, a whole
JSON response, or the first SSE event of a stream, which is then relayed as it comes. A pool that
fails before its first item (an error, a 503, a prompt longer than its context window) hands the
request to the next pool of the chain; after the first item nothing is retried (a failing stream
ends with an error event). What the client got wrong (a 4xx, yielded or raised by the pool) is
answered at once: no fallback, no circuit-breaker count. An error that may be the request's own
(not an outage) is counted against the pool only once another pool has done otherwise: the same
failure in two pools marks a poisoned request, answered then without trying more pools and
counted by no breaker. Responses carry `x-raylane-route`, `-pool`, `-tier` and, where it
happened, `x-raylane-fallback`. When the client goes away, the pool call is cancelled; the pool's
generator aborts the engine request. A background task checks each pool every
`gateway.pool_health_period_s`; a pool that does not answer is skipped until it does.
Embeddings are computed here (MiniLM, from `router.embeddings`), so they need no pool.
While the app drains before shutdown (deployments/drain.py), new requests get 503 with Retry-After
and /health says "draining"; the requests in flight finish.
"""

import asyncio
import base64
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.config import ClusterConfig
from deployments.drain import RETRY_AFTER_S, DrainWatcher
from deployments.errors import (
    OpenAIError,
    cause_of,
    client_error,
    from_validation_error,
    internal_error,
    invalid,
    model_not_found,
    unavailable,
)
from deployments.metrics import FinalItem, RequestSummary, render_cluster_metrics
from deployments.openai_schemas import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    ModelCard,
    ModelList,
    Usage,
)
from deployments.openapi import publish, route_docs
from deployments.request_body import read_json_object
from deployments.request_log import RequestLogMiddleware, note_summary, note_trailing_summary, router_timed
from deployments.routing import build_router
from deployments.sampling import chat_params, completion_params, grammar_param
from engine import EngineDeadError
from engine.grammar_compiler import BoundedWorker, GrammarTimeout
from router import DispatchPlan, FallbackReason, Principal, Resolution, RouterError, Slot
from router.errors import ContextLengthError

logger = logging.getLogger(__name__)
HEALTH_TIMEOUT_S = 5.0
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

app = FastAPI(title="raylane", description="OpenAI-compatible API of a raylane cluster", docs_url=None)
app.add_middleware(RequestLogMiddleware)  # x-request-id, one JSON log line and HTTP metrics per request
publish(app)  # the request and response bodies in /openapi.json (the handlers parse bodies themselves)


def error_response(error: OpenAIError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error.to_dict(), status_code=error.status, headers=headers)


class Draining(OpenAIError):
    def __init__(self) -> None:
        super().__init__(
            "The server is shutting down and takes no new requests; retry shortly.",
            status=503,
            code="draining",
        )


@app.exception_handler(OpenAIError)
async def _openai_error(_: Request, error: OpenAIError) -> JSONResponse:
    headers = {"retry-after": str(RETRY_AFTER_S)} if isinstance(error, Draining) else None
    return error_response(error, headers)


@app.exception_handler(RouterError)
async def _router_error(_: Request, error: RouterError) -> JSONResponse:
    return JSONResponse(error.to_openai(), status_code=error.status, headers=error.headers())


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
    return error_response(OpenAIError(str(error.detail), status=error.status_code, code=code))


@app.exception_handler(Exception)
async def _unexpected(_: Request, error: Exception) -> JSONResponse:
    logger.exception("unhandled error in the gateway")
    return error_response(internal_error())


def is_backpressure(error: BaseException) -> bool:
    from ray.serve.exceptions import BackPressureError

    return isinstance(error, BackPressureError)


def pool_failure(error: BaseException) -> OpenAIError:
    """A failed pool call, as the client should see it."""
    from ray.exceptions import ActorUnavailableError, RayActorError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    if isinstance(error, OpenAIError):
        return error
    if (client := client_error(error)) is not None:
        return client
    if isinstance(error, EngineDeadError):
        return unavailable(f"The model pool's engine failed: {error}")
    if isinstance(error, BackPressureError):
        return OpenAIError("The model pool is overloaded; retry later.", status=503, code="overloaded")
    if isinstance(error, RayActorError | ActorUnavailableError | DeploymentUnavailableError):
        return unavailable("The model pool is unavailable; retry later.")
    logger.error("model pool call failed: %r", error)
    return internal_error(f"The model pool failed: {type(error).__name__}.")


@dataclass(slots=True)
class PoolFailure:
    """A pool that failed before its first item: why (for the chain), what the client would be told,
    and, where the failure may be the request's doing, its signature (type and message), by which
    the same failure in another pool is recognised."""

    pool: str
    reason: FallbackReason
    error: OpenAIError
    signature: str | None = None  # None: the pool's health (outage, dead engine), never the request's


def failure_signature(error: BaseException | OpenAIError) -> str | None:
    """What a failure looks like, for comparing two pools' failures; None when it is about the pool's
    health (unreachable, overloaded, engine dead), which says nothing about the request."""
    from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    if isinstance(error, OpenAIError):
        return f"{error.code}: {error.message}"[:300] if error.status == 500 else None
    cause = cause_of(error)
    health = (EngineDeadError, BackPressureError, DeploymentUnavailableError, TimeoutError, GetTimeoutError)
    if isinstance(cause, (*health, RayActorError, ActorUnavailableError)):
        return None
    return f"{type(cause).__name__}: {cause}"[:300]


def poisoned(first: PoolFailure, second: PoolFailure) -> OpenAIError:
    return internal_error(
        f"The request failed the same way in pools {first.pool!r} and {second.pool!r} "
        f"({second.signature}), so it was not sent to more pools: its content triggers a server "
        "error. Please report it with the x-request-id."
    )


class PoolOutage(Exception):
    """The pool was found down while a request waited for its first item."""


def sse_error(error: OpenAIError) -> str:
    return f"data: {json.dumps(error.to_dict())}\n\n"


async def relay(first: str | FinalItem, call, slot: Slot | None = None, on_done=None):
    """Relay a pool's SSE events; a failure mid-stream becomes an error event (the SDK raises it).
    The response ends with the pool's `FinalItem` (the rest of the pool's stream is read in the
    background). The pool's slot is released when the stream ends; `on_done(tokens)` then counts
    usage: the pool's summary when it came (an event may carry several tokens), else the events
    relayed."""
    finished, failed, events, tokens = False, False, 0, None

    def summarized(summary: RequestSummary | None) -> None:
        nonlocal tokens
        if summary is not None:
            note_summary(summary)
            tokens = summary.prompt_tokens + summary.completion_tokens

    try:
        chunk = first
        if not isinstance(first, FinalItem):
            yield first
            async for chunk in call:
                if isinstance(chunk, FinalItem):
                    break
                if isinstance(chunk, RequestSummary):  # after a stream that failed in the engine
                    summarized(chunk)
                    continue
                if not isinstance(chunk, str):
                    failed, chunk = True, sse_error(pool_failure(chunk))
                elif chunk.startswith('data: {"error"'):
                    failed = True
                events += 1
                yield chunk
        if isinstance(chunk, FinalItem):
            summarized(chunk.summary)
            events += 1
            yield chunk.item
            drain_later(call)
        finished = True
    except asyncio.CancelledError:
        raise
    except Exception as e:
        finished = failed = True
        yield sse_error(pool_failure(e))
    finally:
        if not finished:  # the client went away: stop generating
            call.cancel()
        if slot is not None:  # after the first token: no retry, only the breaker learns of a failure
            slot.failed() if failed else slot.succeeded()
        if on_done is not None:
            on_done(events if tokens is None else tokens)


_draining: set[asyncio.Task] = set()


def drain_later(call) -> None:
    """Read what is left of a pool call (its end) in the background, so that Serve sees the call
    finish: an unread stream would count as a request still running on the replica."""

    async def drain() -> None:
        try:
            async for _ in call:
                pass
        except Exception:  # the response is out already; nothing to tell anyone
            pass

    task = asyncio.get_running_loop().create_task(drain())
    _draining.add(task)
    task.add_done_callback(_draining.discard)


async def parse_body(request: Request, model: type[BaseModel], max_bytes: int) -> Any:
    """The body as `model`, or a 4xx naming what is wrong (size and nesting first, then the JSON)."""
    data = await read_json_object(request, max_bytes)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


def _encode_vector(vector, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()


def _total_tokens(body: str) -> int:
    try:
        return int(json.loads(body).get("usage", {}).get("total_tokens", 0))
    except (ValueError, TypeError, AttributeError):
        return 0


# Module helpers come before the class: `serve.ingress` serializes the app's routes when the class is
# decorated, and names defined after that point would be missing in the replica.


@serve.ingress(app)
class Gateway:
    def __init__(self, config: ClusterConfig | dict[str, Any], pools: dict[str, Any]):
        self.config = ClusterConfig.model_validate(config)
        # The handles were made where the app was built; calls go by gRPC when this replica's Serve
        # runs with it (cluster/serve_env.py), as the proxy's calls to this replica do.
        grpc = os.environ.get("RAY_SERVE_USE_GRPC_BY_DEFAULT") == "1"
        self.pools = {name: handle.options(_by_reference=not grpc) for name, handle in pools.items()}
        self.created = int(time.time())
        import torch

        torch.set_num_threads(1)  # the classifier's short inputs: a second thread spin-waits on shared cores
        self.router = build_router(self.config)  # logs loudly when no API key is configured (open mode)
        self._watcher: asyncio.Task | None = None
        self.grammar_worker: BoundedWorker | None = None  # started by the first request with a grammar
        self.outages: dict[str, asyncio.Event] = {}  # set while the health loop finds the pool down
        context = serve.get_replica_context()
        self.drain = DrainWatcher(context.app_name, context.replica_id.unique_id)

    # -- endpoints --------------------------------------------------------------------------------

    @app.post(
        "/v1/chat/completions", **route_docs(ChatCompletion, ChatCompletionRequest, ChatCompletionChunk)
    )
    async def chat_completions(self, request: Request) -> Response:
        principal = self.authenticate(request)
        req = await parse_body(request, ChatCompletionRequest, self.config.gateway.max_request_body_bytes)
        params, tools = await self.prepare(chat_params, req)
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        resolution = await router_timed(self.router.resolve_async(req.model, messages))
        request_id = uuid.uuid4().hex
        return await self.dispatch(
            principal,
            resolution,
            req.n,
            bool(req.stream),
            request_id,
            lambda pool, priority: pool.chat.remote(req, params, tools, request_id, priority),
        )

    @app.post("/v1/completions", **route_docs(Completion, CompletionRequest, Completion))
    async def completions(self, request: Request) -> Response:
        principal = self.authenticate(request)
        req = await parse_body(request, CompletionRequest, self.config.gateway.max_request_body_bytes)
        self.check_batch(len(req.prompts()))
        params = await self.prepare(completion_params, req)
        texts = [p for p in req.prompts() if isinstance(p, str)]
        resolution = await router_timed(
            self.router.resolve_async(req.model, [{"role": "user", "content": t} for t in texts])
        )
        request_id = uuid.uuid4().hex
        return await self.dispatch(
            principal,
            resolution,
            req.n,
            bool(req.stream),
            request_id,
            lambda pool, priority: pool.completions.remote(req, params, request_id, priority),
        )

    @app.post("/v1/embeddings", **route_docs(EmbeddingResponse, EmbeddingRequest))
    async def embeddings(self, request: Request) -> Response:
        from router import embeddings

        principal = self.authenticate(request)  # MiniLM runs here: keyed like every other endpoint
        self.router.check_rate(principal)
        cfg = self.config.embeddings
        req = await parse_body(request, EmbeddingRequest, self.config.gateway.max_request_body_bytes)
        if not cfg.enabled or req.model != cfg.model_id:
            raise model_not_found(req.model)
        texts = [req.input] if isinstance(req.input, str) else req.input
        if not texts:
            raise invalid("input", "input must not be empty.")
        if not all(isinstance(t, str) for t in texts):
            raise invalid("input", f"{cfg.model_id} takes text; token arrays are not supported.")
        if len(texts) > cfg.max_inputs:
            raise invalid("input", f"At most {cfg.max_inputs} inputs per request, got {len(texts)}.")
        if not all(texts):
            raise invalid("input", "input strings must not be empty.")
        vectors, counts = await asyncio.to_thread(
            lambda: (embeddings.embed(texts), embeddings.count_tokens(texts))
        )
        if req.dimensions is not None and req.dimensions != vectors.shape[1]:
            raise invalid("dimensions", f"{cfg.model_id} returns {vectors.shape[1]} dimensions only.")
        data = [
            Embedding(index=i, embedding=_encode_vector(v, req.encoding_format))
            for i, v in enumerate(vectors)
        ]
        usage = Usage(prompt_tokens=sum(counts), total_tokens=sum(counts))
        body = EmbeddingResponse(data=data, model=cfg.model_id, usage=usage)
        return Response(body.to_json(), media_type="application/json")

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

    @app.get("/health")
    async def health(self) -> JSONResponse:
        """200 when every pool answers, with each pool's load; 503 naming the pools that do not.
        `router` has this gateway replica's view: slots in flight, waiting requests, circuit state."""
        self.watch_pools()
        self.drain.start()
        pools = await self.check_pools()
        healthy = all(p["status"] == "ok" for p in pools.values())
        status = "draining" if self.drain.draining else "ok" if healthy else "degraded"
        body = {
            "status": status,
            "pools": pools,
            "router": self.router_state(),
            "gateway": {"in_flight": self.drain.in_flight, "asyncio_tasks": len(asyncio.all_tasks())},
        }
        return JSONResponse(body, 200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics(self) -> Response:
        """Prometheus text format, aggregated over every gateway and pool replica of the app."""
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(await render_cluster_metrics(), media_type=CONTENT_TYPE_LATEST)

    # -- helpers ----------------------------------------------------------------------------------

    def check_batch(self, prompts: int) -> None:
        """Each prompt of a batch is its own engine request (n of them with `n`): bounded, so that one
        HTTP request cannot queue thousands of sequences."""
        limit = self.config.gateway.max_batch_prompts
        if prompts > limit:
            raise invalid("prompt", f"A batch may hold at most {limit} prompts, got {prompts}.")

    async def prepare(self, fn, req):
        """`fn(req)`: the request's sampling parameters. With a grammar (a schema, regex, EBNF, tool
        definitions) the checks and builds that can take exponential time run in a bounded worker
        process: past `GRAMMAR_TIMEOUT_S` the request gets a 400 naming the field and this event
        loop never waited on it. Without one, here (microseconds)."""
        param = grammar_param(req)
        if param is None:
            return fn(req)
        if self.grammar_worker is None:
            self.grammar_worker = BoundedWorker(preload=("deployments.sampling",))
        try:
            return await self.grammar_worker.run(fn, req)
        except GrammarTimeout as e:
            raise invalid(
                param,
                f"Invalid '{param}': too complex: checking it was stopped, {e}. Simplify the schema, "
                "regex or grammar (nesting, alternatives, repetition counts).",
                code="grammar_too_complex",
            ) from None

    def model_cards(self) -> list[ModelCard]:
        cards = [ModelCard(id=p.model_id, created=self.created) for p in self.config.pools]
        if self.config.embeddings.enabled:
            cards.append(ModelCard(id=self.config.embeddings.model_id, created=self.created))
        return cards

    def check_open(self) -> None:
        self.watch_pools()
        self.drain.start()
        if self.drain.draining:
            raise Draining()

    def authenticate(self, request: Request) -> Principal:
        self.check_open()
        return self.router.authenticate(request.headers, request.client.host if request.client else None)

    async def dispatch(
        self, principal: Principal, resolution: Resolution, n: int, streaming: bool, request_id: str, start
    ) -> Response:
        """Walk the fallback chain: `start(handle, priority)` calls a pool; the first pool whose first
        item is not a failure answers. Errors before a pool answers fall back; nothing after."""
        self.drain.in_flight += 1
        streaming_response = False
        try:
            response = await self._dispatch(principal, resolution, n, streaming, request_id, start)
            streaming_response = isinstance(response, StreamingResponse)
            return response
        finally:
            if not streaming_response:  # a stream counts until its relay ends
                self.drain.in_flight -= 1

    async def _dispatch(
        self, principal: Principal, resolution: Resolution, n: int, streaming: bool, request_id: str, start
    ) -> Response:
        first_pool = self.config.pool(resolution.pools[0])
        if n > first_pool.max_n:
            raise invalid(
                "n", f"n must be at most {first_pool.max_n} for model {resolution.model!r}, got {n}."
            )
        plan = self.router.plan(principal, resolution)
        suspects: list[tuple[Slot, PoolFailure]] = []  # failures not yet counted against their pool
        try:
            return await self._walk(plan, principal, streaming, request_id, start, suspects)
        finally:
            for suspect, _ in suspects:  # no other pool failed the same way: they were the pools'
                suspect.blame()

    async def _walk(
        self,
        plan: DispatchPlan,
        principal: Principal,
        streaming: bool,
        request_id: str,
        start,
        suspects: list[tuple[Slot, PoolFailure]],
    ) -> Response:
        rejected: OpenAIError | None = None  # a pool's context-length answer, if every pool gives one
        while True:
            try:
                slot = await plan.next_slot()
            except RouterError as e:
                headers = plan.headers() | {"x-request-id": request_id}
                if isinstance(e, ContextLengthError) and rejected is not None:
                    return error_response(rejected, headers)
                logger.info("request %s (%s) not served: %s", request_id, principal.key_id, e)
                return JSONResponse(e.to_openai(), status_code=e.status, headers=headers | e.headers())
            call = start(self.pools[slot.pool].options(stream=True), plan.priority)
            first = await self.first_item(call, slot, plan)
            if isinstance(first, PoolFailure):
                if first.reason is FallbackReason.SATURATED:
                    continue  # reported already: busy, not broken
                twin = next((f for _, f in suspects if f.signature == first.signature), None)
                if first.signature is None:
                    slot.failed(first.reason)  # the pool's health: counted now
                elif twin is None:
                    slot.suspect(first.reason)
                    suspects.append((slot, first))
                else:  # the same failure twice: the request's, not the pools'
                    slot.forgive()
                    for suspect, _ in suspects:
                        suspect.forgive()
                    logger.error("request %s is poisoned: %s", request_id, first.signature)
                    return error_response(
                        poisoned(twin, first), plan.headers() | {"x-request-id": request_id}
                    )
                continue  # fall back
            if isinstance(first, OpenAIError) and first.code == "context_length_exceeded":
                slot.client_error()  # the pool is fine; the prompt is too long for it
                plan.chain.leave(FallbackReason.CONTEXT_LENGTH)
                rejected = first
                continue
            headers = plan.headers() | {"x-request-id": request_id}
            if isinstance(first, OpenAIError):  # the client's (4xx): answered as it is
                slot.client_error()
                return error_response(first, headers)
            if not streaming:
                if isinstance(first, FinalItem):
                    if first.summary is not None:
                        note_summary(first.summary)
                    drain_later(call)
                    first = first.item
                else:
                    await note_trailing_summary(call)
                slot.succeeded()
                self.router.record_usage(principal, _total_tokens(first))
                return Response(first, media_type="application/json", headers=headers)

            def on_done(tokens: int) -> None:
                self.drain.in_flight -= 1
                self.router.record_usage(principal, tokens)

            return StreamingResponse(
                relay(first, call, slot, on_done),
                media_type="text/event-stream",
                headers=headers | SSE_HEADERS,
            )

    async def first_item(self, call, slot: Slot, plan: DispatchPlan) -> str | OpenAIError | PoolFailure:
        """The pool's first item (a client error raised by the pool counts as one), or the failure the
        chain may fall back from (not yet reported on the slot, except saturation)."""
        pool = slot.pool
        try:
            first = await self.first_or_outage(call, pool)
        except PoolOutage:
            call.cancel()
            logger.warning("pool %s went down before answering", pool)
            return PoolFailure(pool, FallbackReason.UNHEALTHY, unavailable(f"The pool {pool} is down."))
        except asyncio.CancelledError:
            call.cancel()
            slot.abandoned()
            raise
        except StopAsyncIteration:
            logger.error("pool %s returned nothing", pool)
            return PoolFailure(
                pool, FallbackReason.ERROR, internal_error(f"The pool {pool} returned nothing.")
            )
        except Exception as e:
            if (client := client_error(e)) is not None:
                return client
            if is_backpressure(e):  # Serve's queue for the pool is full: busy, not broken
                slot.abandoned()
                plan.chain.leave(FallbackReason.SATURATED)
                return PoolFailure(pool, FallbackReason.SATURATED, pool_failure(e))
            error = pool_failure(e)
            logger.warning("pool %s failed before answering: %s", pool, error.message)
            return PoolFailure(pool, FallbackReason.ERROR, error, failure_signature(e))
        if isinstance(first, OpenAIError) and first.status >= 500:
            logger.warning("pool %s failed before answering: %s", pool, first.message)
            return PoolFailure(pool, FallbackReason.ERROR, first, failure_signature(first))
        return first

    async def first_or_outage(self, call, pool: str):
        """The call's first item, or PoolOutage when the health loop finds the pool down first. A pool
        without a live replica (its node died) would otherwise keep the request waiting for one."""
        outage = self.outages.setdefault(pool, asyncio.Event())
        first = asyncio.ensure_future(call.__anext__())
        down = asyncio.ensure_future(outage.wait())
        try:
            await asyncio.wait({first, down}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            down.cancel()
            if not first.done():
                first.cancel()
        if not first.done() or first.cancelled():
            raise PoolOutage(pool)
        return first.result()

    def watch_pools(self) -> None:
        """Start the pool health loop (lazily: it needs the replica's running event loop)."""
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch_pools())

    async def _watch_pools(self) -> None:
        while True:
            try:
                await self.check_pools()
            except Exception:
                logger.exception("pool health check failed")
            await asyncio.sleep(self.config.gateway.pool_health_period_s)

    async def check_pools(self) -> dict[str, dict]:
        """Each pool's load, or why it did not answer; the router skips pools that did not."""
        names = list(self.pools)
        results = await asyncio.gather(*(self.probe(n) for n in names), return_exceptions=True)
        pools = {}
        for name, result in zip(names, results, strict=True):
            if isinstance(result, BaseException):
                pools[name] = {"status": "unavailable", "error": f"{type(result).__name__}: {result}"[:300]}
            else:
                pools[name] = {"status": "ok", **result}
            healthy = pools[name]["status"] == "ok"
            self.router.set_pool_healthy(name, healthy)
            outage = self.outages.setdefault(name, asyncio.Event())
            if not healthy:
                outage.set()  # wakes the requests waiting for this pool's first item: they fall back
            elif outage.is_set():
                self.outages[name] = asyncio.Event()
        return pools

    async def probe(self, pool: str) -> dict:
        """One replica's stats. A replica that just died fails at once, and Serve sends the retry to
        another: one dead replica of several does not make the pool look down."""
        try:
            return await asyncio.wait_for(self.pools[pool].stats.remote(), HEALTH_TIMEOUT_S)
        except TimeoutError:
            raise
        except Exception:
            return await asyncio.wait_for(self.pools[pool].stats.remote(), HEALTH_TIMEOUT_S)

    def router_state(self) -> dict:
        state = {}
        for name in self.pools:
            load = self.router.pool_load(name)
            state[name] = {
                "in_flight": load.in_flight,
                "waiting": load.waiting,
                "capacity": load.capacity,
                "circuit": str(self.router.circuit_state(name)),
            }
        return {"open_mode": self.router.open_mode, "pools": state}
