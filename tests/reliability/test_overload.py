"""Ten times a pool's capacity of sheddable traffic, plus a steady premium trickle.

App: pool `main` takes 4 requests at once (8 may wait); tier `free` is sheddable, may hold 2 of the
4 slots (max_pool_share 0.5) and wait 1 s; `premium` is served first. Forty free-tier clients
send requests in a loop and, turned away, wait as OpenAI's SDK does (retry-after-ms, else
Retry-After, when it is at most a minute; else its own 8 s backoff); premium sends one request at a
time. Premium's time to first token must stay within 2x of its unloaded value;
free must get 429s with Retry-After; no 5xx; queues and the replicas' memory stay bounded.

The clients run in a process of their own, as a premium application would: after the rest of the
suite, the test process holds the Ray driver and what earlier tests left, and its TTFT would include
that process's own delays; the free clients run in another, so the premium client's event loop is
not also the flood's.

Unloaded and loaded samples alternate in rounds (the flood pauses until the pool is idle, then
resumes), and the medians are over all rounds: on a shared 2-core machine the background load drifts
over a minute, and one block of unloaded samples followed by one of loaded ones measured that drift
as much as the flood (ratios from 1.2x to 2.4x on the same code).
"""

import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import pytest

from tests.reliability.conftest import deployed, llama_pool, replica_rss_mb

APP = "rel-overload"
CAPACITY, MAX_WAITING = 4, 8
FREE_CLIENTS = 10 * CAPACITY
ROUNDS, SAMPLES_PER_ROUND = 4, 8
KEYS = {"premium": "rel-premium-key", "free": "rel-free-key"}
PREMIUM = {"Authorization": f"Bearer {KEYS['premium']}"}  # /health shows loads to a key holder
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def app(api_server, demo_models):
    config = {
        "pools": [llama_pool(demo_models, "main", max_in_flight=CAPACITY, max_waiting=MAX_WAITING)],
        "tiers": [
            {"name": "premium", "priority": 0},
            {
                "name": "free",
                "priority": 2,
                "sheddable": True,
                "max_pool_share": 0.5,
                "max_queue_depth": 4,
                "max_queue_wait_s": 1.0,
            },
        ],
        "api_keys": {"keys": {key: tier for tier, key in KEYS.items()}, "default_tier": "free"},
    }
    with deployed(api_server, APP, config) as url:
        yield url


def body(max_tokens: int) -> dict:
    messages = [{"role": "user", "content": "write a long poem about the sea"}]
    return {
        "model": "main",
        "messages": messages,
        "stream": True,
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }


async def premium_ttft(http: httpx2.AsyncClient) -> float:
    """Seconds from sending a premium request to its first content token."""
    start = time.perf_counter()
    headers = {"Authorization": f"Bearer {KEYS['premium']}"}
    async with http.stream("POST", "/v1/chat/completions", json=body(8), headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        ttft = None
        async for line in response.aiter_lines():
            if ttft is None and line.startswith("data: {") and '"content":"' in line.replace(" ", ""):
                ttft = time.perf_counter() - start
        assert ttft is not None
        return ttft


async def free_client(
    http: httpx2.AsyncClient, running: asyncio.Event, stop: asyncio.Event, statuses: list, retry_afters: list
):
    headers = {"Authorization": f"Bearer {KEYS['free']}"}
    started = False
    while not stop.is_set():
        if not (started and running.is_set()):  # starting, or paused
            await running.wait()
            # Independent clients arrive at their own moments, not in step with the test's resume.
            await asyncio.sleep(random.uniform(0, 2.0))
            started = True
        response = await http.post("/v1/chat/completions", json=body(48) | {"stream": False}, headers=headers)
        statuses.append(response.status_code)
        if response.status_code == 429:
            retry_after = float(response.headers["retry-after"])  # KeyError = a 429 without it
            retry_afters.append(retry_after)
            # As OpenAI's SDK does: the millisecond hint first, honoured up to a minute. The server
            # jitters it, so clients shed together do not come back in one burst, and counts the
            # clients already told to come back, so forty are spread over what two slots can serve.
            hint_ms = response.headers.get("retry-after-ms")
            wait = int(hint_ms) / 1000 if hint_ms else retry_after
            with contextlib.suppress(TimeoutError):  # a stop ends the wait
                await asyncio.wait_for(stop.wait(), wait if 0 < wait <= 60 else 8.0)


async def flood(url: str) -> dict:
    """The free-tier clients, steered by lines on stdin (`pause`, `resume`, `stop`): their statuses
    and Retry-After values once stopped."""
    limits = httpx2.Limits(max_connections=FREE_CLIENTS + 10)
    async with httpx2.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        running, stop, statuses, retry_afters = asyncio.Event(), asyncio.Event(), [], []
        running.set()
        clients = [
            asyncio.create_task(free_client(http, running, stop, statuses, retry_afters))
            for _ in range(FREE_CLIENTS)
        ]
        while (command := (await asyncio.to_thread(sys.stdin.readline)).strip()) not in ("stop", ""):
            if command == "resume":
                running.set()
            else:
                running.clear()
        stop.set()
        running.set()
        await asyncio.gather(*clients)
        return {"statuses": statuses, "retry_afters": retry_afters}


async def pool_idle(http: httpx2.AsyncClient) -> None:
    """Until pool `main` holds and queues nothing (the paused flood's last requests are done)."""
    while True:
        pool = (await http.get("/health", headers=PREMIUM)).json()["router"]["pools"]["main"]
        if pool["in_flight"] == 0 and pool["waiting"] == 0:
            return
        await asyncio.sleep(0.1)


async def overload(url: str) -> dict:
    """Premium's TTFT without and with the flood, in alternating rounds. The flood runs in a process
    of its own: sharing the premium client's event loop, forty clients' responses delayed its first
    chunk (a premium application does not host its attackers)."""
    async with httpx2.AsyncClient(base_url=url, timeout=120) as http:
        for _ in range(3):  # the first requests after a deploy warm caches, not the measure
            await premium_ttft(http)
        rss_before = replica_rss_mb(APP)
        command = [sys.executable, "-m", "tests.reliability.test_overload", "--flood", url]
        pipe = asyncio.subprocess.PIPE
        flooding = await asyncio.create_subprocess_exec(*command, stdin=pipe, stdout=pipe)
        unloaded, loaded, health = [], [], []

        async def steer(line: str) -> None:
            flooding.stdin.write(line.encode() + b"\n")
            await flooding.stdin.drain()

        for _ in range(ROUNDS):
            await asyncio.sleep(3)  # the flood is on (its first round: the process starts)
            for _ in range(SAMPLES_PER_ROUND):
                loaded.append(await premium_ttft(http))
                health.append((await http.get("/health", headers=PREMIUM)).json())
                await asyncio.sleep(0.2)
            await steer("pause")
            await pool_idle(http)
            for _ in range(SAMPLES_PER_ROUND):
                unloaded.append(await premium_ttft(http))
                await asyncio.sleep(0.2)
            await steer("resume")
        out, _ = await flooding.communicate(b"stop\n")
        assert flooding.returncode == 0, "the flood process failed"
        return {
            "unloaded": unloaded,
            "loaded": loaded,
            **json.loads(out.decode().splitlines()[-1]),
            "health": health,
            "rss_before": rss_before,
            "rss_after": replica_rss_mb(APP),
        }


def run_clients(url: str) -> dict:
    """`overload(url)` in a fresh Python process; its result."""
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "tests.reliability.test_overload", url]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_premium_keeps_its_latency_while_sheddable_traffic_is_shed(app, report):
    result = run_clients(app)
    statuses = result["statuses"]
    unloaded, loaded = statistics.median(result["unloaded"]), statistics.median(result["loaded"])
    assert not [s for s in statuses if s >= 500], "5xx under overload"
    assert set(statuses) <= {200, 429}, set(statuses)
    assert statuses.count(429) > 0 and statuses.count(200) > 0  # shed, yet served within its share
    assert min(result["retry_afters"]) >= 1
    ms = lambda samples: sorted(round(t * 1000) for t in samples)  # noqa: E731
    assert loaded <= 2 * unloaded, (
        f"premium TTFT p50 {loaded * 1000:.0f} ms vs {unloaded * 1000:.0f} unloaded; samples (ms): "
        f"unloaded {ms(result['unloaded'])}, loaded {ms(result['loaded'])}; load average "
        f"{os.getloadavg()}"
    )
    for sample in result["health"]:  # bounded queues: nothing waits beyond the pool's limit
        pool = sample["router"]["pools"]["main"]
        assert pool["in_flight"] <= CAPACITY and pool["waiting"] <= MAX_WAITING, pool
    growth = {k: result["rss_after"][k] - v for k, v in result["rss_before"].items()}
    assert set(growth) == {"Gateway", "ModelPool:main"}
    assert max(growth.values()) < 150, growth  # MiB over hundreds of requests: no per-request leak
    report(
        "overload 10x",
        sent=len(statuses) + 2 * ROUNDS * SAMPLES_PER_ROUND,
        status_429=statuses.count(429),
        status_5xx=0,
        premium_ttft_p50_ms=f"{unloaded * 1000:.0f} -> {loaded * 1000:.0f}",
        rss_growth_mib={k: round(v) for k, v in growth.items()},
    )


if __name__ == "__main__":
    if sys.argv[1] == "--flood":
        print(json.dumps(asyncio.run(flood(sys.argv[2]))))
    else:
        print(json.dumps(asyncio.run(overload(sys.argv[1]))))
