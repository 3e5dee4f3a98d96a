"""`model` -> pools: a pool name, its served model id, `auto` / `raylane-auto`, or a clear 404."""

import pytest

from raylane.config import RouterConfig
from raylane.router.classifier import RouteDecision
from raylane.router.errors import UnknownModelError
from raylane.router.resolve import DIRECT_ROUTE, ModelResolver, PoolSpec

POOLS = [
    PoolSpec("coding", model_id="Qwen/Qwen2.5-Coder-7B-Instruct"),
    PoolSpec("reasoning", model_id="Qwen/Qwen3-30B-A3B"),
    PoolSpec("chat", model_id="meta-llama/Llama-3.1-8B-Instruct"),
    PoolSpec("embeddings-free-pool", model_id="tiny-llama"),
]


def resolver(config: RouterConfig | None = None) -> tuple[ModelResolver, list]:
    seen = []

    def classify(messages):
        seen.append(messages)
        return RouteDecision("reasoning", "reasoning", 0.9, "semantic", {"reasoning": 0.9})

    return ModelResolver(config or RouterConfig(), POOLS, classify), seen


def test_pool_name_and_served_model_id_route_directly_without_classifying():
    r, seen = resolver()
    by_name = r.resolve("coding", [])
    by_id = r.resolve("Qwen/Qwen2.5-Coder-7B-Instruct", [])
    assert by_name.route == by_id.route == "coding"
    assert by_name.pools == by_id.pools == ("coding", "reasoning", "chat")  # the route's fallbacks follow
    assert by_name.decision is None and not seen


@pytest.mark.parametrize("model", ["auto", "raylane-auto"])
def test_auto_asks_the_classifier(model):
    r, seen = resolver()
    messages = [{"role": "user", "content": "prove it"}]
    resolution = r.resolve(model, messages)
    assert seen == [messages]
    assert (resolution.route, resolution.pools) == ("reasoning", ("reasoning", "chat"))
    assert resolution.decision.confidence == 0.9


def test_pool_outside_every_route_is_direct_and_has_no_fallback():
    r, _ = resolver()
    resolution = r.resolve("tiny-llama", [])
    assert (resolution.route, resolution.pools) == (DIRECT_ROUTE, ("embeddings-free-pool",))


def test_named_model_fallback_can_be_switched_off():
    r, _ = resolver(RouterConfig(fallback_for_named_models=False))
    assert r.resolve("chat", []).pools == ("chat",)


def test_unknown_model_is_a_404_naming_it_and_the_choices():
    r, _ = resolver()
    with pytest.raises(UnknownModelError) as excinfo:
        r.resolve("gpt-4o", [])
    error = excinfo.value
    assert error.status == 404 and error.param == "model"
    assert error.to_openai()["error"]["code"] == "model_not_found"
    assert "'gpt-4o'" in error.message and "'auto'" in error.message and "'coding'" in error.message


def test_an_adapter_goes_only_to_the_pools_that_serve_it_and_never_through_auto():
    """An adapter by its name goes to every pool serving it (config order), by `<pool>:<name>` to
    that pool only, never to a fallback without it; a name a pool already uses stays the pool's."""
    pools = [
        PoolSpec("coding", "coder", adapters=("team-a", "shared", "chat")),
        PoolSpec("chat", "chatter", adapters=("shared",)),
    ]
    r = ModelResolver(RouterConfig(), pools, lambda m: RouteDecision("coding", "coding", 1.0, "semantic"))
    team_a = r.resolve("team-a", [])
    assert (team_a.pools, team_a.adapter) == (("coding",), "team-a")
    assert r.resolve("shared", []).pools == ("coding", "chat")
    assert r.resolve("chat:shared", []).pools == ("chat",)
    assert r.resolve("chat", []).adapter is None  # the pool, not coding's adapter named "chat"
    assert r.resolve("coding:chat", []).adapter == "chat"
    assert r.resolve("auto", []).adapter is None
    with pytest.raises(UnknownModelError, match="'coding:team-a'"):
        r.resolve("chat:team-a", [])
