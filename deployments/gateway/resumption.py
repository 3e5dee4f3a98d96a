"""Resuming a request whose pool replica failed, so that its client never sees the failure.

A stream's items carry the token ids whose text they hold (`wire.StreamItem`); the relay adds each
item it passes on to the request's `ResumeState`. When the pool call then fails in a way that is
about the pool's health (the replica or its node died, its engine died: `pool_failures.
resumption_reason`), `Resumer.resume` calls a pool again with that state: the same pool first
(Serve routes around a replica whose actor died), then the route's fallback pools that serve the
same checkpoint. The continuation prefills the prompt plus the tokens already sent, so a greedy
stream goes on exactly as it would have, and sends only what comes after them, with the same `id`
and `created`. A whole (non-streamed) response, or a stream that failed before its first item, has
nothing sent yet: it is asked for again (`Resumer.retry`). At most `gateway.max_resumptions` per
request; each is in the request log and `raylane_stream_resumptions_total{pool,reason}`.

**Same checkpoint.** Another pool continues a stream only if it would compute the same tokens: the
same `model` (as the config names it: a path, a packaged or a demo model), tokenizer, dtype and
quantization (`same_checkpoint`). Only the config is compared, not the files: a pool named by a
path serves whatever that path holds on its node.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from raylane import tracing
from raylane.config import ClusterConfig, PoolConfig
from raylane.deployments.gateway.pool_failures import (
    PoolFailure,
    failure_signature,
    pool_failure,
    resumption_reason,
)
from raylane.deployments.gateway.pool_health import PoolHealth, PoolOutage
from raylane.deployments.gateway.request_record import note_resumption
from raylane.deployments.gateway.spans import end_pool_call, start_pool_call
from raylane.deployments.protocol.errors import OpenAIError, client_error, internal_error, unavailable
from raylane.deployments.protocol.wire import PoolItem, PoolRequest, ResumeState, StreamItem
from raylane.router import FallbackReason

logger = logging.getLogger(__name__)

UP_WAIT_PERIODS, UP_WAIT_MIN_S = 4, 2.0  # how long a resumption waits for a pool marked down


def same_checkpoint(a: PoolConfig, b: PoolConfig) -> bool:
    """Whether pool `b` computes what pool `a` does, token for token (see the module's docstring)."""

    def identity(pool: PoolConfig) -> tuple:
        return (pool.model, pool.engine.tokenizer, pool.engine.dtype, pool.engine.quantization)

    return identity(a) == identity(b)


class Resumer:
    """One request's resumptions: where it may go on (`targets`), how many it has had, and the state
    of its stream."""

    def __init__(
        self,
        config: ClusterConfig,
        pools: dict[str, Any],
        health: PoolHealth,
        request: PoolRequest,
        chain: list[str],
    ) -> None:
        self.pools, self.health, self.request = pools, health, request
        self.request_id = request.request_id
        self.limit = config.gateway.max_resumptions
        self.chain = chain  # the route's pools, in fallback order
        self.config = config
        self.count = 0
        self.state: ResumeState | None = None  # the stream's, from its first item on
        self.tokens_before = 0  # tokens sent before the latest resumption (the pool counts the rest)
        # Tracing (deployments/gateway/spans.py): the span resumptions go under (the relay's stream
        # span; None: the current one) and the span of the call the latest resumption made.
        self.trace_parent: Any = None
        self.call_span: Any = None

    def targets(self, pool: str) -> list[str]:
        """`pool`, then the pools after it in the chain that serve the same checkpoint."""
        own = self.config.pool(pool)
        rest = self.chain[self.chain.index(pool) + 1 :] if pool in self.chain else []
        return [pool, *(p for p in rest if p in self.pools and same_checkpoint(own, self.config.pool(p)))]

    def track(self, item: StreamItem) -> None:
        """Add a relayed item to the stream's state (its first item gives the response's `created`)."""
        if self.state is None:
            self.state = ResumeState(created=_created(item.text))
        self.state.add(item)

    async def retry(self, pool: str, failure: PoolFailure) -> tuple[PoolItem, Any] | None:
        """Ask the same pool again for a request that failed before its first item (nothing was sent):
        (first item, call), or None when the failure does not qualify or the pool fails again."""
        reason = resumption_reason(failure)
        if reason not in ("replica_died", "replica_unavailable", "engine_dead"):
            return None  # a pool found down falls back instead
        return await self._call(pool, reason, None, [pool])

    async def resume(self, pool: str, failure: Any) -> tuple[PoolItem, Any] | None:
        """Continue the stream after `failure` (what ended `pool`'s call: an exception, an error item,
        the engine's failure): (first item of the continuation, its call), or None when the failure
        does not qualify, the limit is reached or no target answers."""
        reason = resumption_reason(failure)
        if reason is None or self.state is None:
            return None
        return await self._call(pool, reason, self.state, self.targets(pool))

    async def _call(
        self, pool: str, reason: str, state: ResumeState | None, targets: list[str]
    ) -> tuple[PoolItem, Any] | None:
        sent = 0 if state is None else state.num_tokens
        attributes = {
            "raylane.pool": pool,
            "raylane.resume.reason": reason,
            "raylane.resume.tokens_sent": sent,
        }
        span = tracing.start("gateway.resume", parent=self.trace_parent, attributes=attributes)
        try:
            resumed = await self._try(reason, state, targets, span)
        finally:
            tracing.end(span, error=None if self.call_span is not None else "not resumed")
        return resumed

    async def _try(
        self, reason: str, state: ResumeState | None, targets: list[str], parent: Any
    ) -> tuple[PoolItem, Any] | None:
        self.call_span = None
        sent = 0 if state is None else state.num_tokens
        for target in targets:
            while self.count < self.limit:
                if not await self._up(target):
                    break  # still down: the next target
                self.count += 1
                model = self.config.pool(target).model_id if tracing.enabled() else ""
                span = start_pool_call(self.request, target, model, self.count + 1, parent, sent)
                resume = None if state is None else _copy(state)
                call = self.request.call(self.pools[target], resume, trace=tracing.carrier(span))
                first = await self._first(call, target)
                if not isinstance(first, PoolFailure | OpenAIError):
                    self.call_span = span
                    logger.warning(
                        "request %s resumed on pool %s after %s (%d tokens sent before)",
                        self.request_id, target, reason, 0 if state is None else state.num_tokens,
                    )  # fmt: skip
                    note_resumption(target, reason)
                    self.tokens_before = 0 if state is None else state.num_tokens
                    return first, call
                again = resumption_reason(first)
                end_pool_call(span, first, again)
                logger.warning("request %s: resuming on pool %s failed: %s", self.request_id, target, again)
                if again is None:  # the continuation was refused (it no longer fits): give up
                    return None
        return None

    async def _up(self, pool: str) -> bool:
        """Whether `pool` is up, waiting a few health periods while the health loop has it down. The
        probe that runs just after a replica died may reach that replica and mark the pool down for a
        period, though a live replica serves; a pool that stays down (its node died) is skipped."""
        deadline = asyncio.get_running_loop().time() + max(
            UP_WAIT_PERIODS * self.health.period_s, UP_WAIT_MIN_S
        )
        while (outage := self.health.outages.get(pool)) is not None and outage.is_set():
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(min(0.1, self.health.period_s))
        return True

    async def _first(self, call, pool: str) -> PoolItem | PoolFailure:
        """The call's first item, or why it failed (as `Dispatcher.first_item`, without a slot: the
        request keeps the one it holds)."""
        try:
            first = await self.health.first_or_outage(call, pool)
        except PoolOutage:
            call.cancel()
            return PoolFailure(pool, FallbackReason.UNHEALTHY, unavailable(f"The pool {pool} is down."))
        except asyncio.CancelledError:
            call.cancel()
            raise
        except StopAsyncIteration:
            return PoolFailure(pool, FallbackReason.ERROR, internal_error(), "returned nothing")
        except Exception as e:
            if (client := client_error(e)) is not None:
                return client
            return PoolFailure(pool, FallbackReason.ERROR, pool_failure(e), failure_signature(e))
        if isinstance(first, OpenAIError) and first.status >= 500:
            return PoolFailure(pool, FallbackReason.ERROR, first, failure_signature(first))
        return first


def _copy(state: ResumeState) -> ResumeState:
    token_ids = {i: list(ids) for i, ids in state.token_ids.items()}
    return ResumeState(state.created, token_ids, dict(state.finish_reasons), state.num_events)


def _created(text: str) -> int:
    """The `created` of a stream's first SSE event."""
    try:
        return int(json.loads(text.removeprefix("data: ").split("\n\n", 1)[0])["created"])
    except (ValueError, KeyError, TypeError):
        return 0
