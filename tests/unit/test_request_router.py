"""The pool's replica router (deployments/gateway/request_router.py), driven as Serve drives it: built with a
deployment id, given the pool's `request_router_kwargs` through `initialize_state`, fed the replica set
through `update_replicas`, asked `choose_replicas` for a `PendingRequest` carrying the gateway's real
`ChatCompletionRequest`, told `on_request_routed`. The replicas are Serve's `RunningReplica` with what
needs a live actor (the queue-length probe, the routing stats Serve keeps) answered from fields, as
Serve's own router tests do (`ray.serve._private.test_utils.FakeRunningReplica`, which this copies:
importing it needs httpx); tests/integration/test_replica_routing.py runs the router in real Serve."""

import uuid
from dataclasses import replace

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

from raylane.config import PoolConfig
from raylane.deployments.app import request_router_config
from raylane.deployments.gateway.request_router import PrefixAwareRouter, block_hashes, request_text
from raylane.deployments.metrics.gateway import gateway_metrics
from raylane.deployments.protocol.openai_schemas import ChatCompletionRequest, CompletionRequest
from raylane.deployments.protocol.wire import AdapterRef, PoolRequest

SYSTEM = (
    "You are the support assistant of a bicycle shop. Answer questions about repairs, parts, "
    "opening hours and orders; be brief and friendly, and never invent a price. " * 3
)
OTHER_SYSTEM = (
    "You are a tutor of Latin grammar. Correct the student's sentences and explain each "
    "declension and conjugation you change, citing the rule. " * 3
)


class Replica(RunningReplica):
    """A replica of deployment `ModelPool:chat` whose routing stats are what a `ModelPool` replica
    reports (`kv_cache_usage`); its requests in flight reach the router as Serve's probes bring them
    (`on_new_queue_len_info`, see `load`)."""

    def __init__(self, name: str, kv_cache_usage: float = 0.0):  # no actor to look up
        self._id = ReplicaID(
            unique_id=name, deployment_id=DeploymentID(name="ModelPool:chat", app_name="raylane")
        )
        self.stats = {"kv_cache_usage": kv_cache_usage, "num_requests_waiting": 0}

    @property
    def replica_id(self) -> ReplicaID:
        return self._id

    @property
    def max_ongoing_requests(self) -> int:
        return 64

    @property
    def node_id(self) -> str:
        return ""

    @property
    def availability_zone(self) -> None:
        return None

    @property
    def multiplexed_model_ids(self) -> set[str]:
        return set()

    @property
    def routing_stats(self) -> dict:
        return self.stats

    async def get_queue_len(self, *, deadline_s: float) -> int:
        raise AssertionError("the router reads Serve's queue-length cache; it does not probe itself")


def load(router: PrefixAwareRouter, replica: Replica, ongoing: int) -> None:
    """What a queue-length probe answer does in Serve: the router's cache learns the replica's load."""
    router.on_new_queue_len_info(replica.replica_id, ongoing)


def chat(system: str, user: str) -> PendingRequest:
    body = ChatCompletionRequest.model_validate(
        {
            "model": "chat",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        }
    )
    metadata = RequestMetadata(request_id=uuid.uuid4().hex, internal_request_id=uuid.uuid4().hex)
    return PendingRequest(args=[PoolRequest("chat", body, None, "req")], kwargs={}, metadata=metadata)


def make_router(*replicas: Replica, **routing) -> PrefixAwareRouter:
    pool = PoolConfig.model_validate(
        {"name": "chat", "model": "demo:raylane-llama-tiny", "engine": {}, "routing": routing}
    )
    config = request_router_config(pool)
    router = PrefixAwareRouter(
        DeploymentID(name="ModelPool:chat", app_name="raylane"),
        DeploymentHandleSource.REPLICA,
        use_replica_queue_len_cache=True,  # Serve's default (RAY_SERVE_ENABLE_QUEUE_LENGTH_CACHE)
    )
    router.initialize_state(**config.request_router_kwargs)
    router.update_replicas(list(replicas))
    return router


async def route(router: PrefixAwareRouter, request: PendingRequest) -> list[str]:
    """Serve's ranks for the request (replica ids, first choice first); the first is then sent it."""
    ranks = await router.choose_replicas(router._replicas_list, request)
    order = [rank[0].replica_id for rank in ranks]
    router.on_request_routed(request, order[0], None)
    return [rid.unique_id for rid in order]


def decisions(reason: str) -> float:
    return gateway_metrics().replica_routing.labels(pool="chat", reason=reason)._value.get()


async def test_requests_sharing_a_system_prompt_follow_the_replica_that_computed_it():
    a, b = Replica("a"), Replica("b")
    router = make_router(a, b)
    first = (await route(router, chat(SYSTEM, "When do you open on Sunday?")))[0]
    hits = decisions("prefix_hit")
    # The replica that has the prompt is now busier; a whole-prompt match still outweighs two requests.
    load(router, a if first == "a" else b, 2)
    for question in ("Do you fix carbon frames?", "How much is a new chain?", "Is my order 4411 ready?"):
        assert (await route(router, chat(SYSTEM, question)))[0] == first
    assert decisions("prefix_hit") == hits + 3
    # Another system prompt goes to the less loaded replica, and then sticks there too.
    other = (await route(router, chat(OTHER_SYSTEM, "Puella rosam amat: is this right?")))[0]
    assert other != first
    assert (await route(router, chat(OTHER_SYSTEM, "And 'puellae rosas amant'?")))[0] == other


async def test_a_replica_far_busier_than_the_rest_loses_its_prefix_preference():
    a, b = Replica("a"), Replica("b")
    router = make_router(a, b, max_imbalance=4)
    load(router, a, 0)
    load(router, b, 1)
    assert (await route(router, chat(SYSTEM, "hello")))[0] == "a"
    least = decisions("least_loaded")
    load(router, a, 4)  # four more in flight than b: past max_imbalance
    load(router, b, 0)
    assert await route(router, chat(SYSTEM, "hello again")) == ["b", "a"]
    assert decisions("least_loaded") == least + 1


async def test_without_a_prefix_the_replica_with_less_kv_in_use_is_preferred():
    router = make_router(Replica("full", kv_cache_usage=0.9), Replica("empty", kv_cache_usage=0.1))
    assert await route(router, chat(SYSTEM, "hi")) == ["empty", "full"]


async def test_a_replica_that_leaves_takes_its_prefixes_and_counts_as_a_scale_event():
    a, b = Replica("a"), Replica("b")
    router = make_router(a, b)
    first = (await route(router, chat(SYSTEM, "hi")))[0]
    kept = b if first == "a" else a
    events = gateway_metrics().scale_events.labels(pool="chat", direction="down")._value.get()
    router.update_replicas([kept])
    assert gateway_metrics().scale_events.labels(pool="chat", direction="down")._value.get() == events + 1
    assert router.index.size(kept.replica_id) == 0 and await route(router, chat(SYSTEM, "again")) == [
        kept.replica_id.unique_id
    ]


async def test_prompt_blocks_agree_as_far_as_the_messages_do():
    one = request_text(chat(SYSTEM, "first question").args)
    two = request_text(chat(SYSTEM, "a different one").args)
    h1, h2 = block_hashes(one, 64), block_hashes(two, 64)
    shared = len(SYSTEM) // 64  # the system prompt's full blocks (its role prefix shifts it by 7)
    assert h1[: shared - 1] == h2[: shared - 1] and h1[-1] != h2[-1]
    assert block_hashes(request_text(chat(OTHER_SYSTEM, "first question").args), 64)[0] != h1[0]
    completion = CompletionRequest.model_validate({"model": "chat", "prompt": SYSTEM})
    assert block_hashes(
        request_text([PoolRequest("completions", completion, None, "r")]), 64
    ) == block_hashes(SYSTEM, 64)


def test_only_the_serve_default_policy_leaves_serves_router():
    from raylane.deployments.app import pool_deployment_options

    pool = PoolConfig.model_validate({"name": "chat", "model": "demo:raylane-llama-tiny", "engine": {}})
    config = pool_deployment_options(pool)["request_router_config"]
    assert config.request_router_class == "raylane.deployments.gateway.request_router.PrefixAwareRouter"
    assert config.request_router_kwargs["block_chars"] == 64  # 4 characters a token, 16-token blocks
    engine = {"block_size": 32}
    sized = PoolConfig.model_validate({"name": "chat", "model": "demo:raylane-llama-tiny", "engine": engine})
    assert pool_deployment_options(sized)["request_router_config"].request_router_kwargs["block_chars"] == 128
    default = pool.model_copy(update={"routing": pool.routing.model_copy(update={"policy": "serve_default"})})
    assert "request_router_config" not in pool_deployment_options(default)


async def test_a_huge_prompt_is_hashed_only_to_its_bound_and_cannot_flush_the_index():
    """One client's 2 MB prompt costs the router `max_blocks_per_request` block hashes, no more, and
    takes that much room in the index: the shop's system prompt stays indexed and keeps its replica."""
    a, b = Replica("a"), Replica("b")
    router = make_router(a, b, max_indexed_blocks=64, max_blocks_per_request=32)
    home = (await route(router, chat(SYSTEM, "When do you open on Sunday?")))[0]
    flood = chat("x" * 2_000_000, "y" * 2_000_000)
    assert len(router._hashes(flood)) == 32
    assert len(request_text(flood.args, 32 * 64)) == 32 * 64
    for replica in (a, b):  # the flood is routed to both replicas, the system prompt's own among them
        router.on_request_routed(flood, replica.replica_id, None)
    assert all(router.index.size(r.replica_id) <= 32 + len(SYSTEM) // 64 + 1 for r in (a, b))
    load(router, a if home == "a" else b, 2)
    assert (await route(router, chat(SYSTEM, "Do you fix carbon frames?")))[0] == home
    assert decisions("prefix_hit") > 0


def adapter_chat(adapter: str, user: str) -> PendingRequest:
    request = chat(SYSTEM, user)
    request.args[0] = replace(request.args[0], adapter=AdapterRef(adapter, (("chat", "/adapters/x"),)))
    return request


async def test_an_adapters_requests_follow_the_replica_holding_it_and_spread_when_it_is_hot():
    a, b = Replica("a"), Replica("b")
    router = make_router(a, b, adapter_max_imbalance=2, prefix_weight=0)
    b.stats["loras"] = ["team-a"]  # b reports the adapter resident
    load(router, a, 0)
    load(router, b, 1)
    assert (await route(router, adapter_chat("team-a", "one")))[0] == "b"  # held beats one request more
    assert (await route(router, chat(SYSTEM, "base model")))[0] == "a"  # no adapter: the least loaded
    load(router, b, 2)  # two more in flight than a: the adapter's preference for b lapses
    assert (await route(router, adapter_chat("team-a", "two")))[0] == "a"
    load(router, a, 1)  # a has it now too (this gateway sent it there): load decides between them
    assert (await route(router, adapter_chat("team-a", "three")))[0] == "a"
    load(router, a, 3)
    assert (await route(router, adapter_chat("team-a", "four")))[0] == "b"


async def test_a_prompt_follows_only_the_replica_that_cached_it_for_its_own_scope():
    """With per-key prefix caching, key B's copy of key A's prompt finds no cached block anywhere, so
    it is routed by load, not after A's replica (whose choice would hint at what A sent)."""
    from dataclasses import replace

    def scoped(salt: str) -> PendingRequest:
        pending = chat(SYSTEM, "first question")
        pending.args[0] = replace(pending.args[0], cache_salt=salt)
        return pending

    router = make_router()
    a, a_again, b = (router._hashes(scoped(s)) for s in ("key:A", "key:A", "key:B"))
    assert a == a_again and a
    assert not set(a) & set(b)
