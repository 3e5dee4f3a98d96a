"""A request that generates nothing (/tokenize, /detokenize) sent to the pool its `model` names,
through the same admission as generation: a slot of the pool, taken in the key's fair turn, so a
flood of them from one key queues behind that key's own share and never ahead of another key's."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi.responses import Response

from raylane.deployments.gateway.request_record import router_timed
from raylane.deployments.protocol.errors import client_error, unavailable
from raylane.router import Principal, RateCharge, Router

logger = logging.getLogger(__name__)


async def admitted_pool_call(
    router: Router,
    pools: dict[str, Any],
    principal: Principal,
    charge: RateCharge,
    model: str,
    messages: list[dict],
    call: Callable[[Any], Awaitable[str]],
) -> Response:
    """`call(handle)`'s JSON answer from the pool `model` resolves to, once admitted; a client
    mistake the pool found is its 4xx (the pool's health untouched), a failure a 503."""
    resolution = await router_timed(router.resolve_async(model, messages))
    plan = router.plan(principal, resolution, charge=charge)
    slot = await plan.next_slot()
    try:
        body = await call(pools[slot.pool])
    except Exception as e:
        slot.abandoned()  # whatever it was, a tokenizer call says nothing of the pool's health
        if (error := client_error(e)) is not None:
            raise error from None
        logger.warning("pool %s failed a tokenizer request: %s", slot.pool, e)
        raise unavailable(f"The pool {slot.pool} could not answer: {type(e).__name__}.") from None
    except BaseException:
        slot.abandoned()
        raise
    slot.succeeded()
    return Response(body, media_type="application/json", headers=plan.headers())
