"""The OpenAI-compatible ingress (FastAPI on Ray Serve).

Per request: parse and validate the body (any mistake -> 400 naming the parameter), resolve
`model` (a pool's name or its served id) to the pool's handle, build the `SamplingParams`, and
forward with `stream=True`. The pool's first item decides the response: an `OpenAIError`, a whole
JSON response, or the first SSE event of a stream, which is then relayed as it comes. When the
client goes away, the pool call is cancelled; the pool's generator aborts the engine request.
Embeddings are computed here (MiniLM, from `router.embeddings`), so they need no pool.
"""

import asyncio
import base64
import json
import logging
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.config import ClusterConfig, PoolConfig
from deployments.errors import (
    OpenAIError,
    from_validation_error,
    internal_error,
    invalid,
    model_not_found,
    unavailable,
)
from deployments.openai_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    ModelCard,
    ModelList,
    Usage,
)
from deployments.sampling import chat_params, completion_params
from engine import EngineDeadError

logger = logging.getLogger(__name__)
HEALTH_TIMEOUT_S = 5.0
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

app = FastAPI(title="raylane", description="OpenAI-compatible API of a raylane cluster", docs_url=None)


def error_response(error: OpenAIError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error.to_dict(), status_code=error.status, headers=headers)


@app.exception_handler(OpenAIError)
async def _openai_error(_: Request, error: OpenAIError) -> JSONResponse:
    return error_response(error)


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
    return error_response(OpenAIError(str(error.detail), status=error.status_code, code=code))


@app.exception_handler(Exception)
async def _unexpected(_: Request, error: Exception) -> JSONResponse:
    logger.exception("unhandled error in the gateway")
    return error_response(internal_error())


def pool_failure(error: BaseException) -> OpenAIError:
    """A failed pool call, as the client should see it."""
    from ray.exceptions import ActorUnavailableError, RayActorError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, EngineDeadError):
        return unavailable(f"The model pool's engine failed: {error}")
    if isinstance(error, BackPressureError):
        return OpenAIError("The model pool is overloaded; retry later.", status=503, code="overloaded")
    if isinstance(error, RayActorError | ActorUnavailableError | DeploymentUnavailableError):
        return unavailable("The model pool is unavailable; retry later.")
    logger.error("model pool call failed: %r", error)
    return internal_error(f"The model pool failed: {type(error).__name__}.")


def sse_error(error: OpenAIError) -> str:
    return f"data: {json.dumps(error.to_dict())}\n\n"


async def relay(first: str, call):
    """Relay a pool's SSE events; a failure mid-stream becomes an error event (the SDK raises it)."""
    finished = False
    try:
        yield first
        async for chunk in call:
            yield chunk if isinstance(chunk, str) else sse_error(pool_failure(chunk))
        finished = True
    except asyncio.CancelledError:
        raise
    except Exception as e:
        finished = True
        yield sse_error(pool_failure(e))
    finally:
        if not finished:  # the client went away: stop generating
            call.cancel()


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    body = await request.body()
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(
            f"We could not parse the JSON body of your request: {e}. (The body must be valid JSON.)",
            param=None,
            code="invalid_json",
        ) from None
    if not isinstance(data, dict):
        raise invalid(None, "The request body must be a JSON object.", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


def _encode_vector(vector, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()


# Module helpers come before the class: `serve.ingress` serializes the app's routes when the class is
# decorated, and names defined after that point would be missing in the replica.


@serve.ingress(app)
class Gateway:
    def __init__(self, config: ClusterConfig | dict[str, Any], pools: dict[str, Any]):
        self.config = ClusterConfig.model_validate(config)
        self.pools = pools  # pool name -> DeploymentHandle
        self.routes: dict[str, PoolConfig] = {}
        for pool in self.config.pools:
            self.routes[pool.name] = self.routes[pool.model_id] = pool
        self.created = int(time.time())

    # -- endpoints --------------------------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        req = await parse_body(request, ChatCompletionRequest)
        pool = self.route(req.model, req.n)
        params, plan = chat_params(req)
        request_id = uuid.uuid4().hex
        call = self.pools[pool.name].options(stream=True).chat.remote(req, params, plan, request_id)
        return await self.respond(call, bool(req.stream), pool, request_id)

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        req = await parse_body(request, CompletionRequest)
        pool = self.route(req.model, req.n)
        params = completion_params(req)
        request_id = uuid.uuid4().hex
        call = self.pools[pool.name].options(stream=True).completions.remote(req, params, request_id)
        return await self.respond(call, bool(req.stream), pool, request_id)

    @app.post("/v1/embeddings")
    async def embeddings(self, request: Request) -> Response:
        from router import embeddings

        cfg = self.config.embeddings
        req = await parse_body(request, EmbeddingRequest)
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

    @app.get("/v1/models")
    async def list_models(self) -> Response:
        return Response(ModelList(data=self.model_cards()).to_json(), media_type="application/json")

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(self, model_id: str) -> Response:
        card = next((c for c in self.model_cards() if c.id == model_id), None)
        if card is None:
            raise model_not_found(model_id)
        return Response(card.to_json(), media_type="application/json")

    @app.get("/health")
    async def health(self) -> JSONResponse:
        """200 when every pool answers, with each pool's load; 503 naming the pools that do not."""
        names = list(self.pools)
        results = await asyncio.gather(
            *(asyncio.wait_for(self.pools[n].stats.remote(), HEALTH_TIMEOUT_S) for n in names),
            return_exceptions=True,
        )
        pools = {}
        for name, result in zip(names, results, strict=True):
            if isinstance(result, BaseException):
                pools[name] = {"status": "unavailable", "error": f"{type(result).__name__}: {result}"[:300]}
            else:
                pools[name] = {"status": "ok", **result}
        healthy = all(p["status"] == "ok" for p in pools.values())
        return JSONResponse(
            {"status": "ok" if healthy else "degraded", "pools": pools}, 200 if healthy else 503
        )

    # -- helpers ----------------------------------------------------------------------------------

    def model_cards(self) -> list[ModelCard]:
        cards = [ModelCard(id=p.model_id, created=self.created) for p in self.config.pools]
        if self.config.embeddings.enabled:
            cards.append(ModelCard(id=self.config.embeddings.model_id, created=self.created))
        return cards

    def route(self, model: str, n: int) -> PoolConfig:
        pool = self.routes.get(model)
        if pool is None:
            raise model_not_found(model)
        if n > pool.max_n:
            raise invalid("n", f"n must be at most {pool.max_n} for model {model!r}, got {n}.")
        return pool

    async def respond(self, call, streaming: bool, pool: PoolConfig, request_id: str) -> Response:
        headers = {"x-raylane-pool": pool.name, "x-request-id": request_id}
        try:
            first = await call.__anext__()
        except asyncio.CancelledError:
            call.cancel()
            raise
        except StopAsyncIteration:
            return error_response(internal_error("The model pool returned nothing."), headers)
        except Exception as e:
            return error_response(pool_failure(e), headers)
        if isinstance(first, OpenAIError):
            return error_response(first, headers)
        if not streaming:
            return Response(first, media_type="application/json", headers=headers)
        return StreamingResponse(
            relay(first, call), media_type="text/event-stream", headers=headers | SSE_HEADERS
        )
