"""The gateway's view of its pools' health, kept apart from their load.

A background loop asks each pool for its stats every `gateway.pool_health_period_s`. That call
goes through the pool's DeploymentHandle, so at a peak it waits for a free slot
(`max_ongoing_requests`) behind the streams being served: its silence says the pool is busy, not
that it is down. So a probe that times out is only a question, answered by Ray and Serve and by the
replica processes outside the slot queue (`replicas_alive`): the pool is down when Serve reports no
replica RUNNING, when none of its replica actors is left in Ray's actor table (a dead process, or
one on a node Ray has declared dead), or when none answers a ping (a hung process). A busy pool
keeps its traffic, and /health shows it as `busy` with the load it last reported. A probe that
fails with an error, twice, means down as before.

A pool found down is skipped by the router and its outage wakes the requests waiting for its
first item, so they fall back. /health answers from the view of the last check (`view`): a call
costs no fan-out to the pools.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from raylane.router import Router

logger = logging.getLogger(__name__)
HEALTH_TIMEOUT_S = 5.0
# How often a pool found down is checked again: its replacement replica should take traffic as soon
# as Serve has it running, not one whole health period later.
DOWN_RECHECK_S = 0.5
POOL_DEPLOYMENT_PREFIX = "ModelPool:"

# pool name -> whether any of its replicas is alive (asked of Ray and Serve, not of the pool)
Liveness = Callable[[str], Awaitable[bool]]


def pool_deployment_name(pool_name: str) -> str:
    return f"{POOL_DEPLOYMENT_PREFIX}{pool_name}"


def serve_liveness(app_name: str) -> Liveness:
    """`replicas_alive` for the pools of the Serve app `app_name`, off the event loop."""

    async def alive(pool: str) -> bool:
        return await asyncio.to_thread(replicas_alive, app_name, pool_deployment_name(pool))

    return alive


def replicas_alive(app_name: str, deployment: str) -> bool:
    """Whether Serve has a RUNNING replica of `deployment` and one of its replica actors answers a
    ping. Serve's view (its controller) lags a death by up to its health-check period; Ray drops a
    dead actor's name at once (and a dead node's actors once it declares the node dead); the ping,
    `get_num_ongoing_requests`, is Serve's own method, answered by the replica's event loop between
    tasks without waiting for a request slot, so a busy replica answers it and a hung one does not.
    Replica actors are named `SERVE_REPLICA::<app>#<deployment>#<id>` in the `serve` namespace."""
    import ray
    from ray import serve

    app = serve.status().applications.get(app_name)
    status = app.deployments.get(deployment) if app is not None else None
    if status is None or status.replica_states.get("RUNNING", 0) == 0:
        return False
    prefix = f"SERVE_REPLICA::{app_name}#{deployment}#"
    pings = []
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith(prefix):
            try:
                replica = ray.get_actor(actor["name"], namespace=actor["namespace"])
            except ValueError:  # gone since the listing
                continue
            pings.append(replica.get_num_ongoing_requests.remote())
    while pings:
        ready, pings = ray.wait(pings, num_returns=1, timeout=HEALTH_TIMEOUT_S)
        if not ready:
            return False  # none answered in time: hung (or on a node not yet declared dead)
        try:
            ray.get(ready[0])
            return True
        except Exception:  # that one died: maybe another answers
            continue
    return False


class PoolOutage(Exception):
    """The pool was found down while a request waited for its first item."""


class PoolHealth:
    def __init__(
        self, pools: dict[str, Any], router: Router | None, period_s: float, alive: Liveness | None = None
    ) -> None:
        """`alive` settles a probe that timed out; without it, silence means down."""
        self.pools, self.router, self.period_s, self.alive = pools, router, period_s, alive
        self.outages: dict[str, asyncio.Event] = {}  # set while the health loop finds the pool down
        self.view: dict[str, dict] = {}  # each pool's status as the last check found it
        self._last_stats: dict[str, tuple[float, dict]] = {}  # (when, stats) of each pool's last answer
        self._checked: asyncio.Event | None = None  # set once the first check has finished
        self._watcher: asyncio.Task | None = None

    def watch(self) -> None:
        """Start the health loop (lazily: it needs the replica's running event loop)."""
        if self._checked is None:
            self._checked = asyncio.Event()
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            try:
                await self.check()
            except Exception:
                logger.exception("pool health check failed")
            down = any(outage.is_set() for outage in self.outages.values())
            await asyncio.sleep(min(self.period_s, DOWN_RECHECK_S) if down else self.period_s)

    async def current(self) -> dict[str, dict]:
        """The last check's view; before the first check has finished, wait for it (every caller
        waits for the same one: /health never fans out to the pools itself)."""
        self.watch()
        await self._checked.wait()
        return self.view

    async def check(self) -> dict[str, dict]:
        """Each pool's status and load; the router skips pools found down."""
        names = list(self.pools)
        pools = dict(zip(names, await asyncio.gather(*(self._status(n) for n in names)), strict=True))
        for name, status in pools.items():
            healthy = status["status"] != "unavailable"
            if self.router is not None:
                self.router.set_pool_healthy(name, healthy)
            outage = self.outages.setdefault(name, asyncio.Event())
            if not healthy:
                outage.set()  # wakes the requests waiting for this pool's first item: they fall back
            elif outage.is_set():
                self.outages[name] = asyncio.Event()
        self.view = pools
        if self._checked is not None:
            self._checked.set()
        return pools

    async def _status(self, pool: str) -> dict:
        try:
            stats = await self.probe(pool)
        except TimeoutError:
            return await self._silent(pool)
        except Exception as e:
            return {"status": "unavailable", "error": f"{type(e).__name__}: {e}"[:300]}
        self._last_stats[pool] = (time.monotonic(), stats)
        return {"status": "ok", **stats}

    async def _silent(self, pool: str) -> dict:
        """A probe that timed out: busy if Ray and Serve still have a live replica of the pool."""
        try:
            alive = self.alive is not None and await self.alive(pool)
        except Exception as e:
            logger.warning("could not ask Serve whether pool %s has live replicas: %r", pool, e)
            alive = False
        if not alive:
            return {"status": "unavailable", "error": f"no replica answered within {HEALTH_TIMEOUT_S:g}s"}
        when, stats = self._last_stats.get(pool, (None, {}))
        age = None if when is None else round(time.monotonic() - when, 1)
        return {"status": "busy", **stats, "stats_age_s": age}

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
                # Cancelled with its client, the pool call ends with Serve's RequestCancelledError
                # rather than as cancelled: retrieved here, not logged as "never retrieved".
                first.add_done_callback(_retrieve)
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


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()
