"""The cluster configs the serving benchmarks start (`bench overhead`, `bench router --live`, `bench
report`): one pool of one replica, so every request meets the same engine.

- pool `chat`: the demo Llama (`demo:raylane-llama-tiny`: 4 layers, hidden 256, float32) or
  `--model DIR`, one CPU per rank (Ray then gives the replica one torch thread), `max_num_seqs` 16,
  a KV cache of 1,024 blocks of 16 tokens (16,384 tokens, enough for 16 requests of 1,000 tokens),
  prefix caching on or off;
- router: the default routes (coding, reasoning, chat) all pointing at `chat`, without fallbacks and
  without keyword/regex rules, so `auto` always runs the semantic classifier and lands on the same
  pool a named request does;
- no /v1/embeddings (the gateway would load a second MiniLM for nothing), open mode (no API keys)
  with one tier, `bench`, without rate limits and with a deep queue.
"""

from raylane.config import ClusterConfig, default_routes

DEMO_MODEL = "demo:raylane-llama-tiny"
POOL = "chat"
MAX_NUM_SEQS = 16


def serving_config(
    model: str = DEMO_MODEL,
    prefix_caching: bool = True,
    max_num_seqs: int = MAX_NUM_SEQS,
    num_kv_blocks: int = 1024,
    cpus_per_rank: float = 1.0,
    ingress: str = "proxy",
) -> ClusterConfig:
    # No keyword/regex rules: a prompt with code in it would skip the classifier, and its forward pass
    # is the cost `auto` adds that the routing benchmark is after.
    rules_off = {"pool": POOL, "fallbacks": [], "keywords": [], "regex": []}
    routes = [r.model_copy(update=rules_off) for r in default_routes()]
    engine = {
        "max_num_seqs": max_num_seqs,
        "num_kv_blocks": num_kv_blocks,
        "cpus_per_rank": cpus_per_rank,
        "enable_prefix_caching": prefix_caching,
        "seed": 0,
    }
    return ClusterConfig.from_dict(
        {
            "http": {"ingress": ingress},
            "gateway": {"num_cpus": 0.1},
            "embeddings": {"enabled": False},
            "pools": [{"name": POOL, "model": model, "engine": engine}],
            "router": {"routes": [r.model_dump() for r in routes], "default_route": "chat"},
            # One tier without rate limits: the default `standard` tier (open mode's) allows 120
            # requests/min, which a concurrency sweep exceeds, and its 429s would be measured instead.
            "tiers": [{"name": "bench", "priority": 0, "max_queue_depth": 1024, "max_queue_wait_s": 600}],
            "api_keys": {"default_tier": "bench"},
        }
    )
