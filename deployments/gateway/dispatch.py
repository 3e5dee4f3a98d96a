"""Sending a request down its route's fallback chain until one pool answers.

The request crosses to a pool as one `PoolRequest` (deployments/protocol/wire.py), called on the
pool's handle with `stream=True`. The pool's first item decides the response: an `OpenAIError`, a
whole JSON response, or the first SSE event of a stream, which `relay` then passes on as it comes.
A pool that fails before its first item (an error, a 503, an outage the health loop found, a prompt
longer than its context window) hands the request to the next pool of the chain. A replica or
engine that dies is survived (deployments/gateway/resumption.py): before the first item the same
pool is asked again; after it the stream is resumed where it stood. Nothing else is retried after
the first item. What the client got wrong (a 4xx, yielded or raised by the pool) is answered at
once: no fallback, no circuit-breaker count. An error that may be the request's own is counted
against its pool only once another pool has done otherwise: the same failure in two pools marks a
poisoned request (deployments/gateway/pool_failures.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import replace
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from raylane import tracing
from raylane.config import ClusterConfig
from raylane.deployments.gateway.drain import DrainWatcher
from raylane.deployments.gateway.lora_adapters import LoRAAdapters
from raylane.deployments.gateway.pool_failures import (
    PoolFailure,
    failure_signature,
    is_backpressure,
    poisoned,
    pool_failure,
)
from raylane.deployments.gateway.pool_health import PoolHealth, PoolOutage
from raylane.deployments.gateway.relay import SSE_HEADERS, BoundedStreamingResponse, drain_later, relay
from raylane.deployments.gateway.request_record import note_summary
from raylane.deployments.gateway.resumption import Resumer
from raylane.deployments.gateway.spans import end_pool_call, start_pool_call, summary_attributes
from raylane.deployments.protocol.errors import (
    OpenAIError,
    client_error,
    internal_error,
    invalid,
    unavailable,
)
from raylane.deployments.protocol.wire import FinalItem, PoolItem, PoolRequest
from raylane.router import (
    DispatchPlan,
    FallbackReason,
    Principal,
    RateCharge,
    Resolution,
    Router,
    RouterError,
    Slot,
)
from raylane.router.errors import ContextLengthError

logger = logging.getLogger(__name__)


def error_response(error: OpenAIError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error.to_dict(), status_code=error.status, headers=(headers or {}) | error.headers())


class Dispatcher:
    def __init__(
        self,
        config: ClusterConfig,
        router: Router,
        pools: dict[str, Any],
        health: PoolHealth,
        drain: DrainWatcher,
        lora: LoRAAdapters,
    ) -> None:
        self.config, self.router, self.pools, self.health, self.drain = config, router, pools, health, drain
        self.lora = lora

    def cache_salt(self, principal: Principal) -> str:
        """The prefix-cache scope of the caller's requests (`gateway.prefix_cache_sharing`)."""
        sharing = self.config.gateway.prefix_cache_sharing
        if sharing == "global" or self.router.open_mode:
            return ""
        return f"tier:{principal.tier.name}" if sharing == "tier" else f"key:{principal.key_id}"

    async def dispatch(
        self,
        principal: Principal,
        resolution: Resolution,
        request: PoolRequest,
        n: int,
        streaming: bool,
        charge: RateCharge | None = None,
    ) -> Response:
        """Walk the fallback chain: the first pool whose first item is not a failure answers. A
        request counts as in flight (for the drain) until its response, or its stream, ends.
        `charge`: the rate limit charged up front (`Router.check_rate`); none: charged here. It is
        settled with the tokens the response used (none if it was not served)."""
        if charge is None:
            charge = self.router.check_rate(principal)
        self.drain.in_flight += 1
        streaming_response = False
        try:
            response = await self._dispatch(principal, resolution, request, n, streaming, charge)
            streaming_response = isinstance(response, StreamingResponse)
            return response
        finally:
            if not streaming_response:  # a stream counts until its relay ends
                self.drain.in_flight -= 1
                charge.settle(0)  # not served (a served one has settled already)

    async def _dispatch(
        self,
        principal: Principal,
        resolution: Resolution,
        request: PoolRequest,
        n: int,
        streaming: bool,
        charge: RateCharge,
    ) -> Response:
        first_pool = self.config.pool(resolution.pools[0])
        if n > first_pool.max_n:
            raise invalid(
                "n", f"n must be at most {first_pool.max_n} for model {resolution.model!r}, got {n}."
            )
        # Each choice of each prompt is its own sequence in the engine: a tier's pool share counts them.
        sequences = n * len(request.body.prompts()) if request.endpoint == "completions" else n
        plan = self.router.plan(principal, resolution, charge=charge, sequences=sequences)
        suspects: list[tuple[Slot, PoolFailure]] = []  # failures not yet counted against their pool
        adapter = None if resolution.adapter is None else self.lora.ref(resolution.adapter, resolution.pools)
        request = replace(
            request,
            priority=plan.priority,
            tenant=principal.key_id,
            cache_salt=self.cache_salt(principal),
            adapter=adapter,
        )
        resumer = Resumer(self.config, self.pools, self.health, request, list(resolution.pools))
        try:
            return await self._walk(plan, principal, streaming, request, suspects, resumer)
        finally:
            for suspect, _ in suspects:  # no other pool failed the same way: they were the pools'
                suspect.blame()

    async def _walk(
        self,
        plan: DispatchPlan,
        principal: Principal,
        streaming: bool,
        request: PoolRequest,
        suspects: list[tuple[Slot, PoolFailure]],
        resumer: Resumer,
    ) -> Response:
        request_id = request.request_id
        rejected: OpenAIError | None = None  # a pool's context-length answer, if every pool gives one
        attempt = 0
        while True:
            try:
                with tracing.span("gateway.admission", **{"raylane.priority": plan.priority}) as span:
                    slot = await plan.next_slot()
                    tracing.set_attributes(span, **{"raylane.pool": slot.pool})
            except RouterError as e:
                headers = plan.headers() | {"x-request-id": request_id}
                if isinstance(e, ContextLengthError) and rejected is not None:
                    plan.charge.settle_error(rejected.status)
                    return error_response(rejected, headers)
                logger.info("request %s (%s) not served: %s", request_id, principal.key_id, e)
                return JSONResponse(e.to_openai(), status_code=e.status, headers=headers | e.headers())
            attempt += 1
            model = self.config.pool(slot.pool).model_id if tracing.enabled() else ""
            call_span = start_pool_call(request, slot.pool, model, attempt)
            call = request.call(self.pools[slot.pool], trace=tracing.carrier(call_span))
            first = await self.first_item(call, slot, plan)
            if isinstance(first, PoolFailure) and (again := await resumer.retry(slot.pool, first)):
                end_pool_call(call_span, first.error, "retried")
                first, call = again  # its replica died before it answered: a live one did
                call_span = resumer.call_span
            if isinstance(first, PoolFailure):
                end_pool_call(call_span, first.error, first.reason.value)
                if first.reason is FallbackReason.SATURATED:  # busy, not broken: reported already
                    if self.config.router.overflow:
                        continue
                    headers = plan.headers() | {"x-request-id": request_id, "retry-after": "1"}
                    return error_response(first.error, headers)
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
                end_pool_call(call_span, first, "context_length")
                slot.client_error()  # the pool is fine; the prompt is too long for it
                plan.chain.leave(FallbackReason.CONTEXT_LENGTH)
                rejected = first
                continue
            headers = plan.headers() | {"x-request-id": request_id}
            if isinstance(first, OpenAIError):  # the client's (4xx): answered as it is
                end_pool_call(call_span, first, "client_error")
                slot.client_error()
                plan.charge.settle_error(first.status)
                return error_response(first, headers)
            if not streaming:
                final = first if isinstance(first, FinalItem) else FinalItem(first)
                summary_attributes(call_span, final.summary)
                end_pool_call(call_span)
                if final.summary is not None:
                    note_summary(final.summary)
                drain_later(call)
                slot.succeeded()
                plan.charge.settle(_total_tokens(final.item))
                return Response(final.item, media_type="application/json", headers=headers)

            def on_done(tokens: int) -> None:
                self.drain.in_flight -= 1
                plan.charge.settle(tokens)

            return BoundedStreamingResponse(
                relay(first, call, slot, on_done, resumer, call_span=call_span),
                write_timeout_s=self.config.gateway.stream_write_timeout_s,
                media_type="text/event-stream",
                headers=headers | SSE_HEADERS,
            )

    async def first_item(self, call, slot: Slot, plan: DispatchPlan) -> PoolItem | PoolFailure:
        """The pool's first item (a client error raised by the pool counts as one), or the failure the
        chain may fall back from (not yet reported on the slot, except saturation)."""
        pool = slot.pool
        try:
            first = await self.health.first_or_outage(call, pool)
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
                if self.config.router.overflow:
                    plan.chain.leave(FallbackReason.SATURATED)
                return PoolFailure(pool, FallbackReason.SATURATED, pool_failure(e))
            error = pool_failure(e)
            logger.warning("pool %s failed before answering: %s", pool, error.message)
            return PoolFailure(pool, FallbackReason.ERROR, error, failure_signature(e))
        if isinstance(first, OpenAIError) and first.status >= 500:
            logger.warning("pool %s failed before answering: %s", pool, first.message)
            return PoolFailure(pool, FallbackReason.ERROR, first, failure_signature(first))
        return first


def _total_tokens(body: str) -> int:
    try:
        return int(json.loads(body).get("usage", {}).get("total_tokens", 0))
    except (ValueError, TypeError, AttributeError):
        return 0
