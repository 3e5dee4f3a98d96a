"""Graceful drain of an app's gateways before shutdown: new requests get 503 + Retry-After while the
requests in flight, streams included, finish (up to a timeout).

Serve itself cannot do this: deleting an app removes its route at once (new requests get a bare
404), and a Serve handle reaches one replica, not all. So whoever shuts the app down (`raylane
serve` on Ctrl-C or SIGTERM) starts a `DrainCoordinator` actor named after the app. Every gateway
replica looks for it a few times a second, reports how many requests it holds and learns whether
to drain; `drain_app` returns when every replica has reported zero since the drain began, or at
the timeout. The actor belongs to the process that drains (not detached): if that process ends
without deleting the app, the gateways find no coordinator and take requests again.
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray

logger = logging.getLogger(__name__)
POLL_PERIOD_S = 0.2  # how often a gateway replica reports; the delay before it turns new requests away
# A replica that has not looked for the coordinator yet is unknown to it: the drain waits this long
# (several polls) before it trusts that the replicas it has heard from are all there are.
SETTLE_S = 1.0
NAMESPACE = "raylane"
RETRY_AFTER_S = 5  # what a draining gateway tells new clients


def coordinator_name(app_name: str) -> str:
    return f"raylane-drain:{app_name}"


@ray.remote(num_cpus=0)
class DrainCoordinator:
    def __init__(self) -> None:
        self.started: float | None = None
        self.reports: dict[str, tuple[int, float]] = {}  # replica -> (requests in flight, reported at)

    def start(self) -> float:
        self.started = time.monotonic()
        return self.started

    def report(self, replica: str, in_flight: int) -> bool:
        """A gateway replica's load; returns whether it must drain."""
        self.reports[replica] = (in_flight, time.monotonic())
        return self.started is not None

    def in_flight(self) -> dict[str, int] | None:
        """Requests each replica held when it last reported, counting only replicas that reported since
        the drain began (so they know); None until every known replica has."""
        if self.started is None or any(at <= self.started for _, at in self.reports.values()):
            return None
        return {replica: count for replica, (count, _) in self.reports.items()}


_held: dict[str, ray.actor.ActorHandle] = {}  # a coordinator lives while its drainer holds a handle


def drain_app(app_name: str, timeout_s: float, on_wait=None) -> dict[str, int]:
    """Drain the app's gateways (this process must be connected to Ray); returns the requests still
    in flight per replica at the end (empty or all zero when everything finished in time).
    `on_wait(in_flight)` is called once when requests are still running at the start."""
    coordinator = DrainCoordinator.options(
        name=coordinator_name(app_name), namespace=NAMESPACE, get_if_exists=True
    ).remote()
    _held[app_name] = coordinator  # the app stays draining after we return, until it is deleted
    ray.get(coordinator.start.remote())
    began = time.monotonic()
    deadline = began + timeout_s
    told = False
    last: dict[str, int] = {}
    while time.monotonic() < deadline:
        last = ray.get(coordinator.in_flight.remote()) or last
        busy = {replica: n for replica, n in last.items() if n}
        if last and not busy and time.monotonic() - began >= SETTLE_S:
            return last
        if busy and not told and on_wait is not None:
            on_wait(busy)
            told = True
        time.sleep(POLL_PERIOD_S)
    return last


class DrainWatcher:
    """In a gateway replica: counts the requests it holds and polls the app's coordinator, if any."""

    def __init__(self, app_name: str, replica: str):
        self.app_name, self.replica = app_name, replica
        self.in_flight = 0
        self.draining = False
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start polling (lazily: it needs the replica's running event loop)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        coordinator = None
        while True:
            try:
                if coordinator is None:  # a GCS lookup: off the event loop
                    name = coordinator_name(self.app_name)
                    coordinator = await asyncio.to_thread(ray.get_actor, name, namespace=NAMESPACE)
                if await coordinator.report.remote(self.replica, self.in_flight):
                    if not self.draining:
                        logger.info("draining: new requests get 503; %d in flight", self.in_flight)
                    self.draining = True
            except (ValueError, ray.exceptions.RayActorError):
                # No coordinator (any more): nobody drains this app. One whose process died without
                # deleting the app must not leave it turning everybody away.
                coordinator, self.draining = None, False
            await asyncio.sleep(POLL_PERIOD_S)
