"""One pool, two replicas, in real Serve: the prefix-aware replica router
(deployments/gateway/request_router.py) and conversation affinity for `auto`
(deployments/gateway/affinity.py), seen as a client sees them through the `openai` SDK: the pool in
`x-raylane-pool`, `x-raylane-decision`, `usage.prompt_tokens_details.cached_tokens` (prompt tokens the
replica found in its prefix cache) and `/metrics`.

The app (under /affinity on the session's Serve): `coding` with two replicas of the demo Llama, `chat`
with one; the default routes, trimmed to these pools. No test asserts a duration.
"""

import re
from concurrent.futures import ThreadPoolExecutor

import httpx2
import pytest

from tests.live_servers import wait_healthy, wait_until

APP = "raylane-affinity"
PREFIX = "/affinity"

PERSONAS = [
    "You are Ada, a patient senior engineer at a logistics company. You review code for correctness "
    "first, then readability, and you always explain the trade-offs of what you suggest.",
    "You are Marco, a cheerful travel agent in Lisbon. You know every neighbourhood, tram line and "
    "pastry shop, and you keep answers short, warm and practical for first-time visitors.",
    "You are Priya, a data scientist who teaches evening classes. You use small worked examples, name "
    "the assumptions behind every method, and warn about common mistakes with real data.",
    "You are Tom, the friendly help desk of a public library. You answer questions about opening "
    "hours, memberships, events and reading suggestions, in plain words and full sentences.",
]
CODING_OPENERS = [
    "Write a Python function that parses a CSV file and returns its rows as a list of dicts.",
    "Implement binary search over a sorted list of integers in Python and return the index.",
    "Write a SQL query that returns the ten customers with the highest total order value.",
    "Fix this JavaScript: const xs = [1,2,3]; for (i = 0; i <= xs.length; i++) console.log(xs[i]);",
    "Write a Rust function that reverses the words of a string in place.",
]
CHAT_OPENERS = [
    "Can you suggest a relaxing plan for a rainy Sunday at home?",
    "What are some good board games for a family with young children?",
    "I'm visiting Lisbon next month. Which neighbourhoods should I stay in?",
    "Recommend a few novels for someone who loved The Remains of the Day.",
    "How can I keep my houseplants alive while I'm away for two weeks?",
]
CODING_FOLLOWUPS = [  # later turns of a chat conversation that turn to code
    "Now write a Python function that sorts these suggestions by cost.",
    "Thanks. Also, how do I reverse a linked list in Java?",
    "Great, and can you give me a regex that matches an email address?",
]
CHAT_FOLLOWUPS = [  # later turns of a coding conversation that turn to everyday things
    "Thanks! Unrelated: what should I cook for dinner tonight?",
    "By the way, any tips for sleeping better before a big deadline?",
    "Last thing: what is a nice gift for a colleague who is retiring?",
]


def conversations() -> list[list[dict]]:
    """20 conversations: a persona, an opener (10 about code, 10 everyday), three turns that drift to
    the other subject."""
    made = []
    for i in range(20):
        coding = i % 2 == 0
        opener = (CODING_OPENERS if coding else CHAT_OPENERS)[(i // 2) % 5]
        later = CHAT_FOLLOWUPS if coding else CODING_FOLLOWUPS
        system = f"{PERSONAS[i % 4]} (Conversation {i}.)"
        made.append([{"role": "system", "content": system}, {"role": "user", "content": opener}, *later])
    return made


@pytest.fixture(scope="module")
def server(api_server, demo_models):
    from ray import serve

    from raylane.config import ClusterConfig
    from raylane.deployments.app import build_app, delete_app

    llama = str(demo_models["raylane-llama-tiny"])
    engine = {"max_num_seqs": 8, "num_kv_blocks": 512, "cpus_per_rank": 0.25, "seed": 0}
    two = {"min_replicas": 2, "max_replicas": 2}
    config = ClusterConfig.from_dict(
        {
            "http": {"host": "127.0.0.1", "port": int(api_server.url.rsplit(":", 1)[1])},
            "gateway": {"num_cpus": 0.1},
            "embeddings": {"enabled": False},
            "pools": [
                {"name": "coding", "model": llama, "engine": engine, "replicas": two},
                {"name": "chat", "model": llama, "engine": engine},
            ],
        }
    )
    serve.run(build_app(config), name=APP, route_prefix=PREFIX)
    url = f"{api_server.url}{PREFIX}"
    wait_healthy(f"{url}/health", 300)
    yield url
    delete_app(APP)


@pytest.fixture
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=120)


def ask(client, model: str, messages: list[dict]):
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=8, temperature=0
    )
    return raw.headers, raw.parse()


def run_conversation(client, turns: list) -> list[tuple[str, str | None, int]]:
    """Each turn's (pool, decision, cached prompt tokens), the assistant's answers kept in the history."""
    messages, seen = turns[:2], []
    for turn in range(4):
        if turn:
            messages = [*messages, {"role": "user", "content": turns[1 + turn]}]
        headers, completion = ask(client, "auto", messages)
        details = completion.usage.prompt_tokens_details
        seen.append((headers["x-raylane-pool"], headers.get("x-raylane-decision"), details.cached_tokens))
        messages = [*messages, {"role": "assistant", "content": completion.choices[0].message.content or ""}]
    return seen


def metric(url: str, name: str, **labels) -> float:
    text = httpx2.get(f"{url}/metrics", timeout=60).text
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            total += float(match.group(2))
    return total


def test_auto_conversations_stay_on_their_pool_and_later_turns_hit_the_prefix_cache(server, client):
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda turns: run_conversation(client, turns), conversations()))
    first_pools = {turns[0][0] for turns in results}
    assert first_pools == {"coding", "chat"}, first_pools  # both pools, so two replicas are exercised
    for i, turns in enumerate(results):
        pools = [pool for pool, _, _ in turns]
        assert pools == [pools[0]] * 4, f"conversation {i} moved: {turns}"
        assert turns[0][1] != "sticky" and [d for _, d, _ in turns[1:]] == ["sticky"] * 3, turns
        assert all(cached > 0 for _, _, cached in turns[1:]), f"conversation {i} missed the cache: {turns}"
    assert metric(server, "raylane_auto_routing_decisions_total", reason="sticky") >= 60
    assert metric(server, "raylane_replica_routing_decisions_total", pool="coding", reason="prefix_hit") > 0


def test_requests_sharing_a_system_prompt_find_it_cached_on_a_two_replica_pool(server, client):
    prompts = [
        f"{PERSONAS[i % 4]} Shop {i}: {'opening hours, returns, repairs. ' * (i + 1)}" for i in range(8)
    ]
    for system in prompts:  # the first request of each prompt computes it on the replica chosen for it
        ask(client, "coding", [{"role": "system", "content": system}, {"role": "user", "content": "hello"}])

    def later(args):
        system, user = args
        _, completion = ask(
            client, "coding", [{"role": "system", "content": system}, {"role": "user", "content": user}]
        )
        return completion.usage.prompt_tokens_details.cached_tokens

    work = [(system, f"question {k} about shop {i}") for k in range(3) for i, system in enumerate(prompts)]
    with ThreadPoolExecutor(4) as pool:
        cached = list(pool.map(later, work))
    assert all(c > 0 for c in cached), cached
    # New prompts went to the replica holding fewer: both replicas computed prompts and later found
    # them cached (each replica's gauge, reported on a timer).
    wait_until(lambda: len(hit_rates(server)) == 2 and all(r > 0 for r in hit_rates(server)), 60, "hit rates")


def hit_rates(url: str) -> list[float]:
    text = httpx2.get(f"{url}/metrics", timeout=60).text
    return [
        float(v) for v in re.findall(r'raylane_prefix_cache_hit_rate\{[^}]*pool="coding"[^}]*\} (\S+)', text)
    ]
