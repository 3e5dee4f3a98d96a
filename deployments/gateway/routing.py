"""The gateway's router: a `router.Router` built from the cluster config.

Which routes the gateway uses (`Router()` requires every route and fallback to name a pool):
- a `router` section written in the config is used as it is; `ClusterConfig` has already checked
  that it names only the cluster's pools;
- without one, the default routes (coding, reasoning, chat) are trimmed to the cluster: a route
  whose pool is missing is dropped, as are fallbacks to missing pools, and `default_route` moves to
  the first route left. If no route is left, `model: "auto"` answers 404 saying to write a `router`
  section; pools named directly still work (route `direct`).

Rate limits are the cluster's, not each replica's: every gateway replica enforces its share of a
tier's limits, `replica_tiers`: requests/min, tokens/min and the per-key concurrency cap divided by
`gateway.num_replicas` (rounded up). Serve's proxy spreads a key's requests over the replicas, so a
busy key gets about its tier's limit in all, with no remote call on the request path and no shared
state to lose. The trade-off: a key whose few requests happen to land on one replica is refused
there at 1/N of its limit while another replica still has budget for it (one replica: exact).
"""

from __future__ import annotations

import logging
import math

from raylane.config import ClusterConfig, RouteConfig, RouterConfig, TierConfig
from raylane.router import PoolSpec, Router
from raylane.router.classifier import RouteDecision, SemanticClassifier
from raylane.router.errors import UnknownModelError
from raylane.router.resolve import DIRECT_ROUTE

logger = logging.getLogger(__name__)


class _NoRoutes:
    """Stands in for the classifier when the cluster has no route: `auto` is an unknown model."""

    def classify(self, messages: list[dict]):
        raise UnknownModelError(
            "The model 'auto' needs semantic routes: add a `router` section to the cluster config "
            "naming this cluster's pools.",
            param="model",
        )


class _OneRoute:
    """Stands in for the classifier when there is one route: `auto` has nothing to choose, so the
    gateway loads no sentence encoder (MiniLM on torch: seconds of CPU at every replica start, and
    the memory they hold). Its decisions say `only`."""

    def __init__(self, routes: RouterConfig) -> None:
        (route,) = routes.routes
        self.decision = RouteDecision(route.name, route.pool, 1.0, "only", {route.name: 1.0})

    def classify(self, messages: list[dict]) -> RouteDecision:
        return self.decision


def torch_on_one_thread() -> None:
    """The gateway's torch work (the classifier) is short inputs: a second thread
    would spin-wait on shared cores. Called where that work is first set up, so a gateway that has
    none never imports torch."""
    import torch

    torch.set_num_threads(1)


def pool_specs(config: ClusterConfig, adapters: dict[str, dict[str, str]] | None = None) -> list[PoolSpec]:
    """`adapters`: each pool's LoRA adapters by name (its config's and those loaded at run time);
    none: its config's."""
    return [
        PoolSpec(
            name=p.name,
            model_id=p.model_id,
            max_context_len=p.engine.max_model_len,
            max_in_flight=p.max_in_flight,
            replica_capacity=p.replicas.max_replicas * p.replicas.max_ongoing_requests,
            max_waiting=p.max_waiting,
            adapters=tuple(p.adapters if adapters is None else adapters.get(p.name, {})),
        )
        for p in config.pools
    ]


def effective_router_config(config: ClusterConfig) -> RouterConfig | None:
    """The routes the gateway uses (see the module docstring); None when no route fits the pools."""
    if "router" in config.model_fields_set:
        return config.router
    pools = {p.name for p in config.pools}
    routes = [
        route.model_copy(update={"fallbacks": [f for f in route.fallbacks if f in pools]})
        for route in config.router.routes
        if route.pool in pools
    ]
    if not routes:
        return None
    names = [r.name for r in routes]
    default = config.router.default_route if config.router.default_route in names else names[0]
    return config.router.model_copy(update={"routes": routes, "default_route": default})


def replica_tiers(tiers: list[TierConfig], replicas: int) -> list[TierConfig]:
    """Each tier with the limits one of `replicas` gateway replicas enforces (see the module doc)."""
    per_key = ("requests_per_minute", "tokens_per_minute", "max_concurrent_per_key")
    return [
        tier.model_copy(
            update={
                f: math.ceil(getattr(tier, f) / replicas) for f in per_key if getattr(tier, f) is not None
            }
        )
        for tier in tiers
    ]


def _routes(config: ClusterConfig) -> RouterConfig:
    """The router config the gateway runs: the effective routes, or the `direct` stand-in."""
    routes = effective_router_config(config)
    if routes is None:
        pools = [p.name for p in config.pools]
        logger.warning("no route fits the pools %s: `auto` is disabled", pools)
        return RouterConfig(
            routes=[RouteConfig(name=DIRECT_ROUTE, pool=pools[0])], default_route=DIRECT_ROUTE, dataset=None
        )
    logger.info("routes: %s", {r.name: [r.pool, *r.fallbacks] for r in routes.routes})
    return routes


def _classifier(routes: RouterConfig, current: Router | None = None):
    """The classifier of `routes` (seconds to train): `current`'s when its routes are the same, one
    reusing `current`'s sentence encoder when only the routes changed."""
    if routes.routes[0].name == DIRECT_ROUTE:
        return _NoRoutes()
    if len(routes.routes) == 1:
        return _OneRoute(routes)
    torch_on_one_thread()
    if current is None or not isinstance(current.classifier, SemanticClassifier):
        return SemanticClassifier(routes)
    if current.config == routes:
        return current.classifier
    old = current.config
    if (old.max_tokens, old.quantize) == (routes.max_tokens, routes.quantize):
        return SemanticClassifier(routes, encoder=current.classifier.encoder)
    return SemanticClassifier(routes)


def build_router(config: ClusterConfig, adapters: dict[str, dict[str, str]] | None = None) -> Router:
    """Loads the semantic classifier (seconds) unless no route fits the pools. `adapters`: see
    `pool_specs`."""
    routes = _routes(config)
    tiers = replica_tiers(config.tiers, config.gateway.num_replicas)
    specs = pool_specs(config, adapters)
    return Router(routes, tiers, config.api_keys, specs, classifier=_classifier(routes))


def classifier_for(router: Router, config: ClusterConfig):
    """The classifier `config`'s routes need: seconds to train when they changed. Off the loop."""
    return _classifier(_routes(config), router)


def update_router(
    router: Router, config: ClusterConfig, classifier, adapters: dict[str, dict[str, str]] | None = None
) -> None:
    """Apply a new cluster config (or a change of the LoRA `adapters`, see `pool_specs`) to a running
    router in place (`Router.update`), on the event loop that its requests run on (the admission
    controller hands slots to waiting requests)."""
    tiers = replica_tiers(config.tiers, config.gateway.num_replicas)
    specs = pool_specs(config, adapters)
    router.update(_routes(config), tiers, config.api_keys, specs, classifier=classifier)
