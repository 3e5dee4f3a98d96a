"""The OpenAI-compatible ingress (FastAPI on Ray Serve): the app and the `Gateway` deployment.

The routes live in one module per API surface (deployments/gateway/routes/), over the core that
authenticates and charges (deployments/gateway/core.py); `Gateway` inherits them all and owns the
state they share: the router, the pools' handles, the dispatcher, the health loop. When the client
goes away, the pool call is cancelled; the pool's generator aborts the engine request. `PoolHealth`
(deployments/gateway/pool_health.py) checks each pool in the background; embeddings are computed here
(deployments/gateway/embeddings.py).
"""

import asyncio
import logging
import os
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from raylane import tracing
from raylane.bounded_worker import start_forkserver
from raylane.config import ClusterConfig
from raylane.deployments import live_config
from raylane.deployments.batch.service import may_hold_batches
from raylane.deployments.gateway.affinity import ConversationAffinity
from raylane.deployments.gateway.batch_api import BatchApi
from raylane.deployments.gateway.core import GRAMMAR_PRELOAD, Draining
from raylane.deployments.gateway.dispatch import Dispatcher, error_response
from raylane.deployments.gateway.drain import RETRY_AFTER_S, DrainWatcher
from raylane.deployments.gateway.embeddings import EMBEDDINGS_PRELOAD
from raylane.deployments.gateway.lora_adapters import LoRAAdapters
from raylane.deployments.gateway.openapi import publish
from raylane.deployments.gateway.pool_health import PoolHealth, pool_deployment_name, serve_liveness
from raylane.deployments.gateway.request_body import return_large_buffers
from raylane.deployments.gateway.request_log import RequestLogMiddleware
from raylane.deployments.gateway.routes import batches, chat, embeddings, lora, responses, server
from raylane.deployments.gateway.routing import build_router, classifier_for, update_router
from raylane.deployments.metrics.gateway import set_config_generation
from raylane.deployments.protocol.errors import OpenAIError, internal_error
from raylane.router import RouterError

logger = logging.getLogger(__name__)

app = FastAPI(title="raylane", description="OpenAI-compatible API of a raylane cluster", docs_url=None)
app.add_middleware(RequestLogMiddleware)  # x-request-id, one JSON log line and HTTP metrics per request
publish(app)  # the request and response bodies in /openapi.json (the handlers parse bodies themselves)
# Each surface's routes, in the order /openapi.json lists them. Added as the app's own routes, not by
# `include_router`: FastAPI 0.137 and later nest an included router, where the `serve.ingress` of
# older Ray releases does not look for the routes it binds to the class.
for surface in (chat, embeddings, responses, batches, lora, server):
    app.router.routes.extend(surface.router.routes)


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


# `serve.ingress` binds each route whose method the class has, its own or inherited, to the replica:
# the route's `self` is this `Gateway`, whichever surface's module defines it. (Ray looks through the
# class's MRO from 2.53: pyproject's floor.)
@serve.ingress(app)
class Gateway(
    chat.ChatRoutes,
    embeddings.EmbeddingsRoutes,
    responses.ResponsesRoutes,
    batches.BatchRoutes,
    lora.LoRAAdapterRoutes,
    server.ServerRoutes,
):
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
        self.grammar_worker = None  # started by the first request with a grammar
        self.drain = DrainWatcher(context.app_name, context.replica_id.unique_id)
        period_s, alive = self.config.gateway.pool_health_period_s, serve_liveness(context.app_name)
        self.pool_health = PoolHealth(self.pools, self.router, period_s, alive)
        self.dispatcher = Dispatcher(
            self.config, self.router, self.pools, self.pool_health, self.drain, self.lora
        )
        self._stored_responses = None
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

    async def check_health(self) -> None:
        """Serve's periodic replica check, on the replica's event loop: it starts the drain watcher of
        a replica that has served nothing yet, so a drain need not wait its whole timeout for it."""
        self.drain.start()

    def _adapters_changed(self) -> None:
        update_router(self.router, self.config, self.router.classifier, self.lora.by_pool())
