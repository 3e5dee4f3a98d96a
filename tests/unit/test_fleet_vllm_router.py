"""The fleet `raylane bench scale` compares raylane against: real `vllm-router` processes (the Rust
wheel) in front of real `raylane sim-server` processes. vllm-router adds fields of its own to a
request (`no_stop_trim`), which a sim-server ignores as `vllm serve` does; `cache_aware` sends a
prompt it has seen to the server that holds its prefix."""

import openai
import pytest

from raylane.bench.fleet import SimServers, VllmRouter, cpu_by_role, role_cpu_since

PROFILE = "llama-3.1-8b-h100"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SYSTEM = "You review pull requests for a payments service. " * 40  # ~400 tokens: 25 KV blocks


@pytest.fixture(scope="module")
def servers():
    with SimServers(PROFILE, 2) as fleet:
        yield fleet


def ask(router: VllmRouter, question: str, system: str = SYSTEM, **extra):
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=60)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, **extra)


def test_vllm_router_streams_from_the_sim_servers(servers):
    with VllmRouter("round_robin", servers.urls) as router:
        before = cpu_by_role()
        chunks = list(ask(router, "Is this safe?", stream=True, stream_options={"include_usage": True}))
        spent = role_cpu_since(before)
        roles = {pid: role for pid, (role, _) in cpu_by_role().items()}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
    assert chunks[-1].usage.completion_tokens == 8
    # The bench finds each process by its role (what a request took of each may be under a clock tick).
    assert roles.get(router.pid) == "vllm-router" and all(roles.get(p) == "sim-servers" for p in servers.pids)
    assert {"vllm-router", "sim-servers"} <= set(spent)


def test_cache_aware_sends_a_known_prefix_where_it_is_cached(servers):
    system = "You review pull requests for a billing service. " * 40  # not sent by the test before
    with VllmRouter("cache_aware", servers.urls) as router:
        first = ask(router, "First question about the diff?", system)
        later = [ask(router, f"Question {i} about the diff?", system) for i in range(4)]
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # Every later request lands where the system prompt already is: its whole blocks come from the cache.
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in later]
    assert all(c > first.usage.prompt_tokens // 2 for c in cached), (cached, first.usage.prompt_tokens)
