"""Conversation affinity (deployments/gateway/affinity.py) over the real `router.Router`, with a classifier
stand-in that sends each turn where its words point (the real classifier has its own tests):
a conversation's later turns keep the pool its first turn was served by."""

from fastapi.responses import Response

from raylane.config import AffinityConfig, RouteConfig, RouterConfig, default_tiers
from raylane.config.router import ApiKeysConfig
from raylane.deployments.gateway.affinity import ConversationAffinity, conversation_key
from raylane.router import PoolSpec, Principal, RouteDecision, Router

STANDARD = default_tiers()[1]
ALICE, BOB = Principal("key-alice", STANDARD), Principal("key-bob", STANDARD)


class ByWords:
    """`coding` when the latest user turn mentions code, else `chat`."""

    def classify(self, messages):
        latest = [m for m in messages if m["role"] == "user"][-1]["content"]
        route = "coding" if "python" in latest.lower() else "chat"
        return RouteDecision(route, route, 0.9, "semantic", {route: 0.9})


def make_router() -> Router:
    routes = [
        RouteConfig(name="coding", pool="coding", fallbacks=["chat"]),
        RouteConfig(name="chat", pool="chat"),
    ]
    config = RouterConfig(routes=routes, default_route="chat", dataset=None)
    pools = [PoolSpec("coding"), PoolSpec("chat")]
    return Router(config, default_tiers(), ApiKeysConfig(), pools, classifier=ByWords())


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def served(pool: str, status: int = 200) -> Response:
    return Response("{}", status_code=status, headers={"x-raylane-pool": pool})


FIRST = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Python help?"},
]
LATER = [
    *FIRST,
    {"role": "assistant", "content": "Sure."},
    {"role": "user", "content": "What should I cook?"},
]


async def test_later_turns_stay_on_the_first_turns_pool_until_forgotten():
    router, clock = make_router(), Clock()
    affinity = ConversationAffinity(AffinityConfig(ttl_s=60), clock)
    first, key = await affinity.resolve(router, ALICE, "auto", FIRST)
    assert first.pools[0] == "coding" and first.decision.method == "semantic"
    affinity.served(key, first, served("coding"))
    later, later_key = await affinity.resolve(router, ALICE, "auto", LATER)  # the classifier alone says chat
    assert later_key == key and later.decision.method == "sticky"
    assert later.route == "coding" and later.pools == ("coding", "chat")
    clock.now = 61  # not heard from for longer than ttl_s: classified afresh
    again, _ = await affinity.resolve(router, ALICE, "auto", LATER)
    assert again.pools[0] == "chat" and again.decision.method == "semantic"


async def test_the_pool_that_answered_is_remembered_and_errors_are_not():
    router = make_router()
    affinity = ConversationAffinity(AffinityConfig())
    first, key = await affinity.resolve(router, ALICE, "auto", FIRST)
    affinity.served(key, first, served("chat"))  # coding failed over to its fallback, chat
    later, _ = await affinity.resolve(router, ALICE, "auto", LATER)
    assert later.pools == ("chat", "coding") and later.decision.method == "sticky"
    other = [{"role": "user", "content": "Python again"}]
    resolution, other_key = await affinity.resolve(router, ALICE, "auto", other)
    affinity.served(other_key, resolution, served("coding", status=429))
    assert affinity.lookup(other_key) is None


async def test_named_models_first_turns_and_a_disabled_map_are_not_sticky():
    router = make_router()
    affinity = ConversationAffinity(AffinityConfig())
    resolution, key = await affinity.resolve(router, ALICE, "chat", LATER)
    assert key is None and resolution.decision is None
    first, key = await affinity.resolve(router, ALICE, "auto", FIRST)
    affinity.served(key, first, served("coding"))
    repeat, _ = await affinity.resolve(router, ALICE, "auto", FIRST)  # a first turn is always classified
    assert repeat.decision.method == "semantic"
    off = ConversationAffinity(AffinityConfig(enabled=False))
    off.remember(key, "coding", "coding")
    assert (await off.resolve(router, ALICE, "auto", LATER))[0].decision.method == "semantic"


async def test_prompt_cache_key_names_the_conversation_and_the_map_is_bounded():
    router = make_router()
    affinity = ConversationAffinity(AffinityConfig(max_conversations=2))
    first, key = await affinity.resolve(router, ALICE, "auto", FIRST, prompt_cache_key="ticket-7")
    affinity.served(key, first, served("coding"))
    # Another first turn with the same key joins it: OpenAI's "requests with this key share a cache".
    turn = [{"role": "user", "content": "What should I cook?"}]
    joined, _ = await affinity.resolve(router, ALICE, "auto", turn, prompt_cache_key="ticket-7")
    assert joined.pools[0] == "coding"
    for n in range(2):
        affinity.remember(f"k{n}", "chat", "chat")
    assert len(affinity) == 2 and affinity.lookup(key) is None  # the least recent went first


def test_the_conversation_is_its_messages_up_to_the_first_user_turn():
    key = conversation_key("key-alice", FIRST)
    assert key == conversation_key("key-alice", LATER) != conversation_key("key-alice", LATER[1:])
    assert conversation_key("key-alice", [{"role": "system", "content": "x"}]) is None


async def test_another_api_key_cannot_steer_a_conversation_it_did_not_start():
    """Bob sends Alice's opening messages, or her prompt_cache_key, and gets a conversation of his own:
    he can neither learn her pool from his routing nor move her later turns by being served elsewhere."""
    router = make_router()
    affinity = ConversationAffinity(AffinityConfig())
    first, alice_key = await affinity.resolve(router, ALICE, "auto", FIRST)
    affinity.served(alice_key, first, served("coding"))
    bobs, bob_key = await affinity.resolve(router, BOB, "auto", LATER)  # the classifier says chat
    assert bob_key != alice_key and bobs.decision.method == "semantic" and bobs.pools[0] == "chat"
    affinity.served(bob_key, bobs, served("chat"))
    alices, _ = await affinity.resolve(router, ALICE, "auto", LATER)
    assert alices.decision.method == "sticky" and alices.pools[0] == "coding"
    turn = [{"role": "user", "content": "What should I cook?"}]
    mine, key = await affinity.resolve(router, ALICE, "auto", [*FIRST[1:]], prompt_cache_key="ticket-7")
    affinity.served(key, mine, served("coding"))
    theirs, _ = await affinity.resolve(router, BOB, "auto", turn, prompt_cache_key="ticket-7")
    assert theirs.decision.method == "semantic" and theirs.pools[0] == "chat"


async def test_the_map_keeps_digests_of_one_size_not_client_text():
    router = make_router()
    affinity = ConversationAffinity(AffinityConfig())
    long_key, opening = "ticket-" + "7" * 10_000, "Python help? " + "secret " * 50_000
    later = [{"role": "user", "content": opening}, *LATER[2:]]
    for cache_key, messages in ((long_key, FIRST), (None, later)):
        resolution, key = await affinity.resolve(router, ALICE, "auto", messages, prompt_cache_key=cache_key)
        affinity.served(key, resolution, served(resolution.pools[0]))
    keys = list(affinity._pools)
    assert len(keys) == 2 and all(len(k) == 32 for k in keys)
    assert not any("ticket" in k or "secret" in k or "Python" in k for k in keys)
