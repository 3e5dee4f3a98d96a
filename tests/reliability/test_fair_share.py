"""A hundred API keys share one pool fairly, whatever each sends at once.

App: one pool of simulated replicas (engine/sim/: the real scheduler, no weights; an L4's ~70 ms
decode steps) that the gateway lets take 8 requests at once (`max_in_flight`), and one tier for 100
keys, with room for every request to wait. The pool is the bottleneck (~20 answers a second), not
the gateway's CPU: a request queued anywhere else would be served in arrival order. Ten keys send 8
requests at a time, back to back; ninety send 2 at a time, so that every key always has a request
waiting (the sharing is work-conserving: a key with nothing waiting leaves its turn to the others).
The gateway's admission decides who goes next (router/admission.py: the waiter whose key holds the
fewest slots, then the key served least recently). Over the run a key sending eight at once must
get no more answers than a key sending two: in arrival order it would get four times as many. No
request may fail, and every key must be served.
"""

import asyncio
import statistics
import time

import httpx2
import pytest

from tests.reliability.conftest import deployed, sim_pool

APP = "rel-fair"
HEAVY, LIGHT = 10, 90  # keys sending HEAVY_AT_ONCE at once, keys sending LIGHT_AT_ONCE
HEAVY_AT_ONCE, LIGHT_AT_ONCE = 8, 2
RUN_S = 30.0
pytestmark = pytest.mark.timeout(300)


def key(i: int) -> str:
    return f"rel-fair-key-{i:03d}"


@pytest.fixture(scope="module")
def app(api_server):
    config = {
        "pools": [
            sim_pool(
                "shared", "llama-3.1-8b-l4", max_in_flight=8, max_waiting=1000, engine={"max_num_seqs": 8}
            )
        ],
        "tiers": [{"name": "standard", "priority": 1, "max_queue_depth": 1000, "max_queue_wait_s": 120}],
        "api_keys": {"keys": {key(i): "standard" for i in range(HEAVY + LIGHT)}},
    }
    with deployed(api_server, APP, config) as url:
        yield url


async def load(url: str) -> tuple[dict[int, list[int]], dict[int, int]]:
    """Each key's statuses, and its answers that came within RUN_S: every loop sends until then, and
    what is still queued at the end is served after it (a key sending 8 at once has 8 queued, a key
    sending 2 has 2: that drain is arrival order, not the sharing)."""
    statuses: dict[int, list[int]] = {i: [] for i in range(HEAVY + LIGHT)}
    within: dict[int, int] = dict.fromkeys(statuses, 0)
    body = {"model": "shared", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
    end = time.monotonic() + RUN_S
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx2.AsyncClient(base_url=url, timeout=120, limits=limits) as http:

        async def loop(i: int) -> None:
            headers = {"Authorization": f"Bearer {key(i)}"}
            while time.monotonic() < end:
                response = await http.post("/v1/chat/completions", json=body, headers=headers)
                statuses[i].append(response.status_code)
                within[i] += time.monotonic() < end

        # Light keys' loops start first: the heavy keys' first requests must not find the pool empty.
        loops = [loop(i) for i in range(HEAVY, HEAVY + LIGHT) for _ in range(LIGHT_AT_ONCE)]
        loops += [loop(i) for i in range(HEAVY) for _ in range(HEAVY_AT_ONCE)]
        await asyncio.gather(*loops)
    return statuses, within


def test_a_hundred_keys_get_equal_shares_of_a_full_pool(app, report):
    statuses, served = asyncio.run(load(app))

    failed = {i: s for i, s in statuses.items() if set(s) != {200}}
    assert not failed, failed  # none lost, none turned away
    heavy = statistics.mean(served[i] for i in range(HEAVY))
    light = statistics.mean(served[i] for i in range(HEAVY, HEAVY + LIGHT))
    counts = list(served.values())
    jain = sum(counts) ** 2 / (len(counts) * sum(c * c for c in counts))  # 1.0: all equal
    report(
        "fair share: 100 keys, 10 sending 8 at once, 90 sending 2",
        answers_within_run=sum(counts),
        heavy_key_mean=round(heavy, 1),
        light_key_mean=round(light, 1),
        fewest=min(counts),
        jain_index=round(jain, 3),
    )
    assert min(counts) >= 1
    assert heavy <= 1.5 * light, (heavy, light)
