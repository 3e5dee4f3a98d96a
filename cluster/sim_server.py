"""`raylane sim-server --profile P --port N`: one simulated engine behind an OpenAI-compatible HTTP server,
in one process, with no Ray: what an external router (vllm-router's `round_robin`, `cache_aware`, ...)
fronts as if it were a `vllm serve`, so it and raylane's gateway can front the same simulated fleet.

It serves `/v1/chat/completions` and `/v1/completions` (whole and SSE streams, with usage) through the
pool's own serving code (`OpenAIServingChat`, `OpenAIServingCompletion` on a `MeteredLLM`),
`/v1/models`, `/health`, `/version`, and `/metrics` under vLLM's names (deployments/metrics/vllm_names.py).
The engine (engine/sim/) steps on a thread of this process. A request asking for a grammar
(`response_format` JSON, `structured_outputs`, `tools`) is a 400 naming that field: the simulated engine
runs none.
"""

import argparse
import logging
import time
import uuid
from contextlib import aclosing

MEDIA_SSE = "text/event-stream"
logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from raylane.config import SIM_PROFILES

    parser.add_argument(
        "--profile",
        required=True,
        help=f"hardware profile: {', '.join(SIM_PROFILES)}, or a profile YAML file",
    )
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument(
        "--served-model-name", help="the model id clients send (default: the model the profile stands for)"
    )
    parser.add_argument("--max-num-seqs", type=int, help="default: the profile's")
    parser.add_argument("--num-kv-blocks", type=int, help="default: the profile's")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    app = build_app(args.profile, args.served_model_name, args.max_num_seqs, args.num_kv_blocks)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def engine_config(profile: str, max_num_seqs: int | None = None, num_kv_blocks: int | None = None):
    from raylane.config import SIM_PROFILES, EngineConfig

    fields = {"model": f"sim:{profile}"} if profile in SIM_PROFILES else {"model": profile}
    if profile not in SIM_PROFILES:
        fields |= {"backend": "simulated", "sim_profile": profile}
    if max_num_seqs is not None:
        fields["max_num_seqs"] = max_num_seqs
    if num_kv_blocks is not None:
        fields["num_kv_blocks"] = num_kv_blocks
    return EngineConfig(**fields)


def build_app(
    profile: str,
    served_model_name: str | None = None,
    max_num_seqs: int | None = None,
    num_kv_blocks: int | None = None,
):
    """The server's FastAPI app; its engine starts at once (and stops with the app's lifespan)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.exposition import CONTENT_TYPE_LATEST

    from raylane.deployments.gateway.request_body import parse_bytes
    from raylane.deployments.metrics.pool import MeteredLLM, PoolMetrics, engine_stats
    from raylane.deployments.metrics.vllm_names import VllmNamesCollector
    from raylane.deployments.pool.serving_chat import OpenAIServingChat
    from raylane.deployments.pool.serving_completion import OpenAIServingCompletion
    from raylane.deployments.protocol.errors import OpenAIError, invalid
    from raylane.deployments.protocol.openai_schemas import ChatCompletionRequest, CompletionRequest
    from raylane.deployments.protocol.sampling import chat_params, completion_params, grammar_param
    from raylane.deployments.protocol.wire import FinalItem
    from raylane.engine import AsyncLLM

    config = engine_config(profile, max_num_seqs, num_kv_blocks)
    llm = AsyncLLM(config)
    sim = llm.engine.profile
    model_id = served_model_name or sim.model
    names = {model_id, config.model}
    metrics = PoolMetrics("sim", model_id)
    registry = CollectorRegistry()
    registry.register(VllmNamesCollector(metrics, model_id))
    metered = MeteredLLM(llm, metrics)
    chat = OpenAIServingChat(metered, model_id, llm.max_model_len)
    completion = OpenAIServingCompletion(metered, model_id, llm.max_model_len)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        yield
        llm.shutdown()

    app = FastAPI(title=f"raylane sim-server ({sim.name})", lifespan=lifespan)
    app.state.llm = llm

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, error: OpenAIError) -> JSONResponse:
        return JSONResponse(error.to_dict(), status_code=error.status, headers=error.headers())

    def check(req) -> None:
        if req.model not in names:
            raise OpenAIError(
                f"The model `{req.model}` does not exist.", status=404, param="model", code="model_not_found"
            )
        if (param := grammar_param(req)) is not None:
            raise invalid(param, f"'{param}': the simulated engine runs no grammars or tool calls.")

    async def respond(items, stream: bool) -> Response:
        first = await items.__anext__()
        if isinstance(first, OpenAIError):
            await items.aclose()
            raise first
        if not stream:
            await items.aclose()
            return Response(first.item, media_type="application/json")

        async def body():
            async with aclosing(items):  # a client gone aborts the engine request
                item = first
                while True:
                    yield sse_text(item)
                    if isinstance(item, FinalItem):
                        return
                    item = await items.__anext__()

        return StreamingResponse(body(), media_type=MEDIA_SSE)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await parse_bytes(
            known_fields(await request.body(), ChatCompletionRequest), ChatCompletionRequest
        )
        check(req)
        params, plan = chat_params(req)
        return await respond(chat.chat(req, params, plan, uuid.uuid4().hex), bool(req.stream))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await parse_bytes(known_fields(await request.body(), CompletionRequest), CompletionRequest)
        check(req)
        params = completion_params(req)
        return await respond(completion.completion(req, params, uuid.uuid4().hex), bool(req.stream))

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "object": "model",
            "created": created,
            "owned_by": "raylane-sim",
            "max_model_len": llm.max_model_len,
        }
        return {"object": "list", "data": [{"id": model_id, **card, "root": sim.model}]}

    @app.get("/health")
    async def health() -> Response:
        try:
            await llm.check_health()
        except Exception:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": "raylane-sim", "profile": sim.name}

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        metrics.set_engine_stats(await llm.run_in_engine(engine_stats))
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


def known_fields(body: bytes, schema) -> bytes:
    """The body without the top-level fields `schema` does not know, as `vllm serve` takes a request
    (it logs and ignores them; raylane's gateway refuses them, as OpenAI does): routers add their own,
    vllm-router's `no_stop_trim` among them."""
    import json

    try:
        request = json.loads(body)
    except ValueError:
        return body  # the schema's parse names the problem
    if not isinstance(request, dict):
        return body
    known = {name for name, field in schema.model_fields.items()} | {
        field.alias for field in schema.model_fields.values() if field.alias
    }
    if unknown := set(request) - known:
        logger.info("ignored request fields: %s", sorted(unknown))
        return json.dumps({k: v for k, v in request.items() if k in known}).encode()
    return body


def sse_text(item) -> str:
    """The SSE text of one pool item (a stream's events, or its last item's)."""
    from raylane.deployments.protocol.wire import FinalItem, StreamItem

    if isinstance(item, FinalItem):
        return item.item
    return item.text if isinstance(item, StreamItem) else item
