"""`/metrics` against the live app: a known workload, then the scraped values a dashboard would show.

Counters are cumulative over the test session, so every check compares a scrape before and after.
Replicas report to the aggregator about once a second: checks poll until the numbers arrive (no
test asserts a duration).
"""

import glob
import json
import os
import time
import uuid
from collections import Counter

import httpx2
import pytest
from prometheus_client.parser import text_string_to_metric_families

TIMEOUT_S = 60


def scrape(url: str, key: str | None = None) -> dict[tuple[str, frozenset], float]:
    """/metrics of the app at `url`, read with API key `key` where it has keys."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx2.get(f"{url}/metrics", headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels) -> float:
    """Sum of the samples named `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def wait_for(condition, what: str, timeout_s: float = TIMEOUT_S):
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)
    return result


class Tally:
    """What the clients saw, per pool: usage sums, finish reasons, engine requests, streams."""

    def __init__(self):
        self.prompt, self.completion, self.requests, self.streamed = (
            Counter(),
            Counter(),
            Counter(),
            Counter(),
        )
        self.reasons: dict[str, Counter] = {}

    def add(self, pool: str, usage, reasons: list[str], engine_requests: int = 1, streamed: bool = False):
        self.prompt[pool] += usage.prompt_tokens
        self.completion[pool] += usage.completion_tokens
        self.requests[pool] += engine_requests
        self.streamed[pool] += engine_requests if streamed else 0
        self.reasons.setdefault(pool, Counter()).update(reasons)


def run_workload(client) -> Tally:
    tally = Tally()
    msgs = [{"role": "user", "content": "Name three colours."}]
    for model, pool in (("raylane-llama-tiny", "chat"), ("reasoning", "reasoning")):
        r = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, seed=1)
        tally.add(pool, r.usage, [c.finish_reason for c in r.choices])
        r = client.chat.completions.create(model=model, messages=msgs, max_tokens=5, n=2, seed=2)
        tally.add(pool, r.usage, [c.finish_reason for c in r.choices])
        for k in range(2):
            stream = client.chat.completions.create(
                model=model,
                messages=msgs,
                max_tokens=7 + k,
                stream=True,
                stream_options={"include_usage": True},
            )
            reasons, usage = [], None
            for chunk in stream:
                reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
                usage = chunk.usage or usage
            tally.add(pool, usage, reasons, streamed=True)
    r = client.completions.create(model="chat", prompt=["one two", "three four five"], max_tokens=4)
    tally.add("chat", r.usage, [c.finish_reason for c in r.choices], engine_requests=2)
    stream = client.completions.create(
        model="chat", prompt="six seven", max_tokens=5, stream=True, stream_options={"include_usage": True}
    )
    reasons, usage = [], None
    for chunk in stream:
        reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
        usage = chunk.usage or usage
    tally.add("chat", usage, reasons, streamed=True)
    return tally


@pytest.fixture(scope="module")
def workload(api_server):
    import openai

    client = openai.OpenAI(base_url=api_server.base_url, api_key="x", max_retries=0, timeout=120)
    before = settled_scrape(api_server.url)
    return before, run_workload(client)


def settled_scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """/metrics once its counters have stopped moving: each replica reports its increments once a
    second, so what an earlier test's last requests counted can land a second after they ended, and
    would be taken for this workload's."""

    def counters(samples: dict) -> dict:
        # (each scrape is an HTTP request the gateway counts: those are left out)
        return {
            k: v
            for k, v in samples.items()
            if k[0].endswith(("_total", "_count", "_sum")) and not k[0].startswith("raylane_http_")
        }

    last = scrape(url)
    for _ in range(20):
        time.sleep(1.5)  # longer than a report interval
        samples = scrape(url)
        if counters(samples) == counters(last):
            return samples
        last = samples
    raise AssertionError("the app's counters kept moving for 30 s before the workload")


def test_token_and_request_counters_match_what_clients_received(api_server, workload):
    before, tally = workload

    def delta(samples, name, **labels):
        return value(samples, name, **labels) - value(before, name, **labels)

    def arrived():
        after = scrape(api_server.url)
        done = all(
            delta(after, "raylane_e2e_request_latency_seconds_count", pool=p) >= tally.requests[p]
            for p in tally.requests
        )
        return done and after

    after = wait_for(arrived, "the workload's requests in /metrics")
    for pool in ("chat", "reasoning"):
        labels = {"pool": pool}
        assert delta(after, "raylane_prompt_tokens_total", **labels) == tally.prompt[pool]
        assert delta(after, "raylane_generation_tokens_total", **labels) == tally.completion[pool]
        for reason, count in tally.reasons[pool].items():
            assert delta(after, "raylane_request_success_total", finished_reason=reason, **labels) == count
        assert delta(after, "raylane_request_success_total", **labels) == sum(tally.reasons[pool].values())
        # vLLM's meaning: one TTFT per engine request, streamed or not (a streamed one is one request).
        assert delta(after, "raylane_time_to_first_token_seconds_count", **labels) == tally.requests[pool]
        assert tally.streamed[pool] >= 2
        assert delta(after, "raylane_e2e_request_latency_seconds_count", **labels) == tally.requests[pool]
        assert delta(after, "raylane_inter_token_latency_seconds_count", **labels) > 0
        assert value(after, "raylane_prefix_cache_queries_total", **labels) >= value(
            after, "raylane_prefix_cache_hits_total", **labels
        )
        model = {"chat": "raylane-llama-tiny"}.get(pool)
        if model:
            assert value(after, "raylane_prompt_tokens_total", pool=pool, model=model) > 0
    chat_requests = 2 * 4  # two pools, each two non-streamed and two streamed chats
    assert delta(
        after, "raylane_http_requests_total", endpoint="/v1/chat/completions", status_code="200"
    ) == (chat_requests)
    assert delta(after, "raylane_http_requests_total", endpoint="/v1/completions", status_code="200") == 2


def test_kv_use_and_queues_return_to_idle(api_server, workload):
    def idle():
        after = scrape(api_server.url)
        kv = [v for (n, _), v in after.items() if n == "raylane_kv_cache_usage_perc"]
        pools = {dict(ls)["pool"] for (n, ls) in after if n == "raylane_kv_cache_usage_perc"}
        busy = value(after, "raylane_num_requests_running") + value(after, "raylane_num_requests_waiting")
        return pools >= {"chat", "reasoning"} and busy == 0 and all(v == 0 for v in kv) and after

    after = wait_for(idle, "idle KV use")
    for name in ("raylane_kv_cache_usage_perc", "raylane_num_requests_running"):
        replicas = {dict(ls).get("replica") for (n, ls) in after if n == name}
        assert None not in replicas and len(replicas) >= 2  # one gauge per pool replica


def test_errors_are_counted_by_status_code(api_server, client):
    import openai

    before = scrape(api_server.url)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])

    def counted():
        after = scrape(api_server.url)
        labels = {"endpoint": "/v1/chat/completions", "status_code": "404"}
        n = value(after, "raylane_http_requests_total", **labels) - value(
            before, "raylane_http_requests_total", **labels
        )
        return n == 1

    wait_for(counted, "the 404 in /metrics")


def test_a_whole_response_its_client_left_is_counted_as_aborted(api_server):
    """A non-streamed request has no output before its last, so the pool only learns what it made
    from the engine's abort. Counted as one `abort` with the tokens it generated, not as finished."""
    body = {
        "model": "chat",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2000,
        "ignore_eos": True,
    }
    labels = {"pool": "chat"}
    before = scrape(api_server.url)
    request_id = f"test-{uuid.uuid4().hex[:12]}"
    with pytest.raises(httpx2.TimeoutException):
        httpx2.post(
            f"{api_server.base_url}/chat/completions",
            json=body,
            headers={"x-request-id": request_id},
            timeout=1.0,
        )

    def delta(samples, name, **more):
        return value(samples, name, **labels, **more) - value(before, name, **labels, **more)

    def counted():
        after = scrape(api_server.url)
        return delta(after, "raylane_request_success_total", finished_reason="abort") == 1 and after

    after = wait_for(counted, "the aborted request in /metrics")
    assert 0 < delta(after, "raylane_generation_tokens_total") < 2000
    assert delta(after, "raylane_request_success_total") == 1  # and not also as finished ("length")
    # The client hung up: its 499 (nginx's "client closed request"), not a 5xx an on-call would see.
    http = {"endpoint": "/v1/chat/completions"}
    assert wait_for(lambda: http_delta(before, scrape(api_server.url), "499", **http) == 1, "the 499")
    assert http_delta(before, scrape(api_server.url), "500", **http) == 0
    [line] = wait_for(lambda: request_log_lines(request_id), "the request's log line")
    assert json.loads(line)["status"] == 499
    noise = [line for line in gateway_log_lines() if "never retrieved" in line]
    assert not noise, noise[-3:]


def http_delta(before: dict, after: dict, status_code: str, **labels) -> float:
    name, labels = "raylane_http_requests_total", {**labels, "status_code": status_code}
    return value(after, name, **labels) - value(before, name, **labels)


def serve_logs() -> str:
    import ray

    return os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs", "serve")


def request_log_lines(request_id: str) -> list[str]:
    lines = []
    for path in glob.glob(os.path.join(serve_logs(), "raylane_requests_*.jsonl")):
        with open(path) as f:
            lines += [line for line in f if request_id in line]
    return lines


def gateway_log_lines() -> list[str]:
    lines = []
    for path in glob.glob(os.path.join(serve_logs(), "replica_*Gateway*.log")):
        with open(path, errors="replace") as f:
            lines += f.readlines()
    return lines


def test_request_log_line_has_the_fields_and_never_the_prompt(api_server):

    request_id = f"test-{uuid.uuid4().hex[:12]}"
    secret = "zebra-secret-7731"
    r = httpx2.post(
        f"{api_server.base_url}/chat/completions",
        json={"model": "chat", "messages": [{"role": "user", "content": secret}], "max_tokens": 3},
        headers={"x-request-id": request_id},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert r.headers.get_list("x-request-id") == [request_id]
    usage = r.json()["usage"]
    lines = wait_for(lambda: request_log_lines(request_id), "the request's log line")
    assert len(lines) == 1 and secret not in lines[0]
    entry = json.loads(lines[0])
    assert entry["request_id"] == request_id and entry["endpoint"] == "/v1/chat/completions"
    assert entry["status"] == 200 and entry["pool"] == "chat" and entry["route"]
    assert entry["prompt_tokens"] == usage["prompt_tokens"]
    assert entry["completion_tokens"] == usage["completion_tokens"]
    assert entry["finish_reason"] == r.json()["choices"][0]["finish_reason"]
    assert entry["ttft_s"] >= 0 and entry["latency_s"] >= entry["ttft_s"]
    assert {"tier", "fallback"} <= set(entry)


def test_a_fallback_and_a_shed_are_counted_with_their_labels(router_server):
    """On the router test app (make_router_config): `reasoning` has a 64-token context and
    falls back to `chat`; `chat` takes one request at a time and the `free` tier may not wait."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.live_servers import ROUTER_KEYS

    server = router_server

    def chat(tier: str, model: str, content: str = "hi") -> httpx2.Response:
        return httpx2.post(
            f"{server.base_url}/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4},
            headers={"Authorization": f"Bearer {ROUTER_KEYS[tier]}"},
            timeout=180,
        )

    def in_flight(pool: str) -> int:
        headers = {"Authorization": f"Bearer {ROUTER_KEYS['premium']}"}
        health = httpx2.get(f"{server.url}/health", headers=headers, timeout=60).json()
        return health["router"]["pools"][pool]["in_flight"]

    before = scrape(server.url, ROUTER_KEYS["premium"])
    r = chat("premium", "reasoning", " ".join(["tell me about the weather"] * 40))
    assert r.status_code == 200, r.text
    assert r.headers["x-raylane-fallback"] == "reasoning;reason=context_length"
    server.set_fault("chat", "hold")
    with ThreadPoolExecutor(1) as pool:
        try:
            premium = pool.submit(chat, "premium", "chat")
            wait_for(lambda: in_flight("chat") == 1, "premium to take chat's slot")
            shed = chat("free", "chat")
        finally:
            server.set_fault("chat", None)
        assert shed.status_code == 429 and shed.json()["error"]["code"] == "overloaded", shed.text
        assert premium.result().status_code == 200

    def delta(samples, name, **labels):
        return value(samples, name, **labels) - value(before, name, **labels)

    fallback = {"from_pool": "reasoning", "to_pool": "chat", "reason": "context_length"}

    def counted():
        after = scrape(server.url, ROUTER_KEYS["premium"])
        return delta(after, "raylane_fallbacks_total", **fallback) >= 1 and after

    after = wait_for(counted, "the fallback in /metrics")
    assert delta(after, "raylane_fallbacks_total", **fallback) == 1
    assert delta(after, "raylane_fallbacks_total") == 1
    assert delta(after, "raylane_shed_total", tier="free") == 1
    assert delta(after, "raylane_shed_total") == 1
    assert delta(after, "raylane_route_decisions_total", route="reasoning") == 1
    assert delta(after, "raylane_route_decisions_total", route="chat") == 2
    assert (
        delta(after, "raylane_http_requests_total", endpoint="/v1/chat/completions", status_code="429") == 1
    )
    assert delta(after, "raylane_router_latency_seconds_count") == 3  # each request resolved once


def test_raylane_status_shows_every_pool_with_its_replicas(api_server, workload, capsys):
    from raylane.cluster.cli import main
    from raylane.cluster.status import collect

    def reported():
        rows, _ = collect("raylane")
        pools = {r.name: r for r in rows}
        return all(pools.get(p.name) and pools[p.name].replicas for p in api_server.config.pools) and pools

    pools = wait_for(reported, "every pool's replica to report")
    for pool in api_server.config.pools:
        row = pools[pool.name]
        assert (row.replicas_running, row.replicas_total) == (1, 1) and row.status == "HEALTHY"
        assert len(row.replicas) == 1 and row.model == pool.model_id
    assert pools["Gateway"].replicas_running == api_server.config.gateway.num_replicas
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:4] == ["POOL", "MODEL", "HEALTH", "REPLICAS"]
    for pool in api_server.config.pools:
        line = next(line for line in out.splitlines() if line.startswith(pool.name + " "))
        assert pool.model_id in line and " 1/1 " in line


def test_the_aggregator_outlives_the_placement_group_of_the_replica_that_made_it(ray_cluster):
    """Whichever replica reports first creates the app's aggregator; a pool replica runs in a placement
    group that captures its children. The aggregator must not land in it: when that replica dies or
    scales down, Serve removes the group and everything in it, and the totals would be lost (and
    `/metrics` would answer 500 while the aggregator restarted)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from raylane.deployments.metrics.aggregator import get_aggregator
    from tests.live_servers import wait_until

    app = "aggregator-placement"

    @ray.remote(num_cpus=0.01)
    class Replica:  # as Serve starts a pool replica: in its placement group, capturing children
        def report(self) -> bool:
            key = ("raylane_requests", "raylane_requests_total", (("pool", "p"),))
            return ray.get(get_aggregator(app).report.remote("r1", 1, {}, {key: 3.0}, {}))

    group = placement_group([{"CPU": 0.01}])
    ray.get(group.ready())
    strategy = PlacementGroupSchedulingStrategy(group, placement_group_capture_child_tasks=True)
    replica = Replica.options(scheduling_strategy=strategy).remote()
    assert ray.get(replica.report.remote())
    aggregator = get_aggregator(app, create=False)
    pid = ray.get(aggregator.__ray_call__.remote(lambda self: __import__("os").getpid()))
    remove_placement_group(group)  # the replica dies with it

    def replica_gone() -> bool:
        try:
            ray.get(replica.report.remote(), timeout=60)
        except ray.exceptions.RayActorError:
            return True
        return False

    wait_until(replica_gone, 60, "the replica gone with its placement group")
    # Same process, totals kept.
    assert ray.get(aggregator.__ray_call__.remote(lambda self: __import__("os").getpid())) == pid
    assert b"raylane_requests_total" in ray.get(aggregator.render.remote())
    ray.kill(aggregator)
