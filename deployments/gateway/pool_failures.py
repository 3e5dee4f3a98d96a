"""A pool call that failed, as the client and the fallback chain see it.

`pool_failure` says what the client is told; `failure_signature` says whether the failure is about
the pool's health (unreachable, overloaded, engine dead: counted against the pool at once) or may be
the request's own doing. The same signature from two pools marks a poisoned request (`poisoned`):
answered then, without trying more pools and counted by no breaker.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from raylane.deployments.protocol.errors import (
    OpenAIError,
    cause_of,
    client_error,
    internal_error,
    unavailable,
)
from raylane.deployments.protocol.wire import EngineDeadError
from raylane.router import FallbackReason

logger = logging.getLogger(__name__)


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
        return OpenAIError("The model pool is overloaded; retry later.", status=429, code="overloaded")
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


def resumption_reason(failure: BaseException | OpenAIError | PoolFailure) -> str | None:
    """Why a request may be resumed on another replica after `failure` (a pool call's exception, the
    error it yielded, or a failure before its first item), or None when it may not: only the pool's
    health qualifies (a replica or its node died, its engine died, no replica answers); anything that
    may be the request's own doing would only fail again, and a client error is the client's."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    from ray.serve.exceptions import DeploymentUnavailableError

    if isinstance(failure, PoolFailure):
        if failure.signature is not None or failure.reason is FallbackReason.SATURATED:
            return None
        if failure.reason is FallbackReason.UNHEALTHY:
            return "unavailable"
        failure = failure.error
    if isinstance(failure, OpenAIError):  # a pool answers 503 only when its engine has died
        return "engine_dead" if failure.status == 503 and failure.code == "service_unavailable" else None
    cause = cause_of(failure)
    if isinstance(cause, EngineDeadError):
        return "engine_dead"
    if isinstance(cause, ActorUnavailableError):  # a RayActorError too: what a killed replica gives
        return "replica_unavailable"
    if isinstance(cause, ActorDiedError | RayActorError):
        return "replica_died"
    if isinstance(cause, DeploymentUnavailableError):
        return "unavailable"
    return None


def poisoned(first: PoolFailure, second: PoolFailure) -> OpenAIError:
    return internal_error(
        f"The request failed the same way in pools {first.pool!r} and {second.pool!r} "
        f"({second.signature}), so it was not sent to more pools: its content triggers a server "
        "error. Please report it with the x-request-id."
    )
