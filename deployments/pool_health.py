"""The gateway's view of its pools' health: a background loop asks each pool for its stats every
`gateway.pool_health_period_s`; a pool that does not answer is marked unhealthy in the router (which
skips it) and its outage wakes the requests waiting for its first item, so they fall back."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from router import Router

logger = logging.getLogger(__name__)
HEALTH_TIMEOUT_S = 5.0


class PoolOutage(Exception):
    """The pool was found down while a request waited for its first item."""


class PoolHealth:
    def __init__(self, pools: dict[str, Any], router: Router, period_s: float) -> None:
        self.pools, self.router, self.period_s = pools, router, period_s
        self.outages: dict[str, asyncio.Event] = {}  # set while the health loop finds the pool down
        self._watcher: asyncio.Task | None = None

    def watch(self) -> None:
        """Start the health loop (lazily: it needs the replica's running event loop)."""
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            try:
                await self.check()
            except Exception:
                logger.exception("pool health check failed")
            await asyncio.sleep(self.period_s)

    async def check(self) -> dict[str, dict]:
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

    def router_state(self) -> dict:
        """This gateway replica's view for /health: slots in flight, waiting requests, circuit state."""
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
