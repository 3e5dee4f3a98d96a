"""The gateway's pool health: a probe that times out is a busy pool unless Ray and Serve say its
replicas are gone. (The pools here are stand-ins for Serve handles; the live version, with Serve's and
Ray's answers, is tests/integration/test_router_live.py's busy-pool test.)"""

import asyncio

import pytest

from raylane.deployments.gateway import pool_health
from raylane.deployments.gateway.pool_health import PoolHealth


class Pool:
    """A stand-in DeploymentHandle whose `stats` answers, or hangs as a replica full of streams does."""

    def __init__(self):
        self.silent = False

    @property
    def stats(self):
        return self

    def remote(self):
        return asyncio.sleep(3600) if self.silent else asyncio.sleep(0, {"num_requests_running": 3})


@pytest.fixture(autouse=True)
def short_timeout(monkeypatch):
    monkeypatch.setattr(pool_health, "HEALTH_TIMEOUT_S", 0.05)


def liveness(answer: bool):
    async def alive(pool: str) -> bool:
        return answer

    return alive


async def test_a_pool_too_busy_to_answer_is_busy_with_its_last_load_and_keeps_its_traffic():
    pool = Pool()
    health = PoolHealth({"chat": pool}, None, 1.0, liveness(True))
    assert (await health.check())["chat"] == {"status": "ok", "num_requests_running": 3}
    pool.silent = True
    view = (await health.check())["chat"]
    assert view["status"] == "busy" and view["num_requests_running"] == 3 and view["stats_age_s"] >= 0
    assert not health.outages["chat"].is_set()  # requests waiting for its first item keep waiting
    assert health.view["chat"] == view  # what /health shows until the next check


async def test_a_silent_pool_whose_replicas_are_gone_is_down_and_its_waiters_fall_back():
    pool = Pool()
    pool.silent = True
    health = PoolHealth({"chat": pool}, None, 1.0, liveness(False))
    assert (await health.check())["chat"]["status"] == "unavailable"
    assert health.outages["chat"].is_set()


async def test_without_a_way_to_ask_serve_silence_means_down():
    pool = Pool()
    pool.silent = True
    assert (await PoolHealth({"chat": pool}, None, 1.0).check())["chat"]["status"] == "unavailable"


class FailingPool(Pool):
    """A stand-in whose `stats` fails (a pool with no live replica) until `failing` is cleared."""

    def __init__(self):
        super().__init__()
        self.failing = True

    def remote(self):
        if self.failing:
            raise RuntimeError("no replica")
        return super().remote()


async def test_a_pool_found_down_is_checked_again_soon_not_a_whole_period_later():
    """Its replacement replica takes traffic as soon as it runs: the health loop re-checks a pool that
    is down every DOWN_RECHECK_S, though its period here is a minute."""
    pool = FailingPool()
    health = PoolHealth({"chat": pool}, None, 60.0, liveness(False))
    health.watch()
    try:
        for _ in range(100):
            if "chat" in health.outages and health.outages["chat"].is_set():
                break
            await asyncio.sleep(0.05)
        assert health.view["chat"]["status"] == "unavailable"
        pool.failing = False
        for _ in range(100):
            if health.view["chat"]["status"] == "ok":
                break
            await asyncio.sleep(0.05)
        assert health.view["chat"]["status"] == "ok" and not health.outages["chat"].is_set()
    finally:
        health._watcher.cancel()


async def test_health_calls_before_the_first_check_share_it():
    """/health never fans out to the pools itself: callers before the first check wait for the loop's."""
    pool = Pool()
    calls = []
    remote = pool.remote
    pool.remote = lambda: calls.append(1) or remote()
    health = PoolHealth({"chat": pool}, None, 60.0, liveness(True))
    try:
        views = await asyncio.gather(*(health.current() for _ in range(10)))
        assert all(v["chat"]["status"] == "ok" for v in views) and len(calls) == 1
    finally:
        health._watcher.cancel()
