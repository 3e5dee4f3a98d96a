"""OpenAI's Batch API, /v1/files and /v1/batches: records and runs in the app's batch actor
(deployments/batch/); `run_batch_line` serves the batch actor one line at a time."""

import json
import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from raylane import tracing
from raylane.config.batch import BATCH_TIER, batch_tier
from raylane.deployments.gateway.batch_api import BatchApi, list_limit, owner, page
from raylane.deployments.gateway.core import PROMPT_BYTES_PER_TOKEN, GatewayCore
from raylane.deployments.gateway.embeddings import ResultTooLarge
from raylane.deployments.gateway.openapi import route_docs
from raylane.deployments.gateway.request_body import read_body
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
from raylane.deployments.protocol.errors import OpenAIError, internal_error, invalid
from raylane.router import Principal, RouterError
from raylane.router.errors import RateLimitError

logger = logging.getLogger(__name__)
# The Gateway method that serves each endpoint a batch line may name (config.batch.BATCH_ENDPOINTS);
# the chat, completions, embeddings and Responses surfaces define them.
BATCH_SERVERS = {
    "/v1/chat/completions": "serve_chat",
    "/v1/completions": "serve_completions",
    "/v1/embeddings": "serve_embeddings",
    "/v1/responses": "serve_responses",
}

router = APIRouter()


class BatchRoutes(GatewayCore):
    batch_api: BatchApi

    @router.post("/v1/files", **route_docs(FileObject))
    async def create_file(self, request: Request) -> Response:
        """Upload a batch's input file (multipart/form-data: `file`, `purpose` = batch)."""
        principal = self.authenticate(request)
        self.router.check_rate(principal)  # one request; the lines' tokens are the batch tier's
        return JSONResponse(await self.batch.upload(request, principal))

    @router.get("/v1/files", **route_docs(FileList))
    async def list_files(self, request: Request) -> Response:
        principal = self.authenticate(request)
        limit = list_limit(request, 10_000, 10_000)
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise invalid("order", "order must be 'asc' or 'desc'.")
        args = (request.query_params.get("purpose"), limit + 1, request.query_params.get("after"), order)
        return JSONResponse(page(await self.batch.call("files", owner(principal), *args), limit))

    @router.get("/v1/files/{file_id}", **route_docs(FileObject))
    async def retrieve_file(self, file_id: str, request: Request) -> Response:
        return JSONResponse(await self.batch.call("file", owner(self.authenticate(request)), file_id))

    @router.get("/v1/files/{file_id}/content")
    async def file_content(self, file_id: str, request: Request) -> Response:
        return await self.batch.content(self.authenticate(request), file_id)  # streamed in pages

    @router.delete("/v1/files/{file_id}", **route_docs(FileDeleted))
    async def delete_file(self, file_id: str, request: Request) -> Response:
        return JSONResponse(await self.batch.call("delete_file", owner(self.authenticate(request)), file_id))

    @router.post("/v1/batches", **route_docs(Batch, BatchCreateRequest))
    async def create_batch(self, request: Request) -> Response:
        principal = self.authenticate(request)
        self.router.check_rate(principal)
        body = await read_body(request, self.config.gateway.max_request_body_bytes)
        return JSONResponse(await self.batch.create_batch(body, principal))

    @router.get("/v1/batches", **route_docs(BatchList))
    async def list_batches(self, request: Request) -> Response:
        principal = self.authenticate(request)
        limit = list_limit(request, 20, 100)
        args = (owner(principal), limit + 1, request.query_params.get("after"))
        return JSONResponse(page(await self.batch.call("batches", *args), limit))

    @router.get("/v1/batches/{batch_id}", **route_docs(Batch))
    async def retrieve_batch(self, batch_id: str, request: Request) -> Response:
        return JSONResponse(await self.batch.call("batch", owner(self.authenticate(request)), batch_id))

    @router.post("/v1/batches/{batch_id}/cancel", **route_docs(Batch))
    async def cancel_batch(self, batch_id: str, request: Request) -> Response:
        return JSONResponse(
            await self.batch.call("cancel_batch", owner(self.authenticate(request)), batch_id)
        )

    @property
    def batch(self) -> BatchApi:
        if not self.config.batch.enabled:
            raise OpenAIError(
                "The Batch API is off on this cluster (batch.enabled).", status=404, code="not_found"
            )
        return self.batch_api

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
