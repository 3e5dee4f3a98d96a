"""Which pools a request's `model` means: a pool by name or served model id, `auto` -> the classifier,
or a LoRA adapter of a pool (its name, or `<pool>:<name>`), which only that pool serves: no fallback
to a pool without it, and `auto` never picks one (an adapter is a team's, not the router's choice)."""

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from raylane.config import AUTO_MODELS, RouterConfig
from raylane.router.classifier import RouteDecision
from raylane.router.errors import UnknownModelError

logger = logging.getLogger(__name__)
DIRECT_ROUTE = "direct"  # route reported for a named pool that no route starts from


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """What the router needs to know of one pool; the gateway builds these from its pool config."""

    name: str
    model_id: str | None = None  # the served model id clients may name (OpenAI `model`)
    max_context_len: int | None = None  # prompt tokens it accepts; None = no limit known
    max_in_flight: int | None = None  # requests the gateway sends at once; None = RouterConfig default
    replica_capacity: int = 0  # what the pool's replicas take at once, at most (max_replicas x max_ongoing)
    max_waiting: int | None = None  # requests that may queue for it; None = RouterConfig default
    adapters: tuple[str, ...] = ()  # names of the LoRA adapters it serves


@dataclass(frozen=True, slots=True)
class Resolution:
    model: str  # as the client asked
    route: str
    pools: tuple[str, ...]  # candidates, in order: the route's pool, then its fallbacks
    decision: RouteDecision | None = None  # set when the classifier chose
    adapter: str | None = None  # the LoRA adapter the pools run it with


class ModelResolver:
    def __init__(
        self,
        config: RouterConfig,
        pools: Sequence[PoolSpec],
        classify: Callable[[list[dict]], RouteDecision] | None = None,
    ):
        """`classify(messages)` decides `auto` requests; without it, `auto` is an unknown model."""
        self._config, self._classify = config, classify
        self._by_name: dict[str, str] = {}
        for pool in pools:
            self._by_name[pool.name] = pool.name
            if pool.model_id:
                self._by_name.setdefault(pool.model_id, pool.name)
        # model -> (pools serving the adapter, the adapter): `<pool>:<name>` that pool only; a bare
        # name every pool that serves it (in config order), unless it names a pool or model
        self._adapters: dict[str, tuple[tuple[str, ...], str]] = {}
        for pool in pools:
            for adapter in pool.adapters:
                self._adapters[f"{pool.name}:{adapter}"] = ((pool.name,), adapter)
                if adapter not in self._by_name:
                    serving, _ = self._adapters.get(adapter, ((), adapter))
                    self._adapters[adapter] = ((*serving, pool.name), adapter)
        self._route_of_pool = {}
        for route in config.routes:
            self._route_of_pool.setdefault(route.pool, route)

    def resolve(self, model: str, messages: list[dict]) -> Resolution:
        if model in AUTO_MODELS and self._classify is not None:
            decision = self._decide(messages)
            route = self._config.route(decision.route)
            return Resolution(model, route.name, (route.pool, *route.fallbacks), decision)
        pool = self._by_name.get(model)
        if pool is None and model in self._adapters:
            serving, adapter = self._adapters[model]
            return Resolution(model, DIRECT_ROUTE, serving, adapter=adapter)
        if pool is None:
            raise UnknownModelError(self._unknown_message(model), param="model")
        route = self._route_of_pool.get(pool)
        if route is None:
            return Resolution(model, DIRECT_ROUTE, (pool,))
        fallbacks = tuple(route.fallbacks) if self._config.fallback_for_named_models else ()
        return Resolution(model, route.name, (pool, *fallbacks))

    def _decide(self, messages: list[dict]) -> RouteDecision:
        """The classifier's decision; if it fails on this text, the default route: the content is the
        pool's to judge (a 400 if it cannot be served), and a classifier bug must not become a 500."""
        try:
            return self._classify(messages)
        except Exception:
            logger.exception("the classifier failed on a request; routing it to the default route")
            return RouteDecision(self._config.default_route, None, 0.0, "default")

    def model_names(self) -> list[str]:
        """Every `model` value this router accepts, for /v1/models and error messages."""
        auto = list(AUTO_MODELS) if self._classify is not None else []
        return auto + list(self._by_name) + list(self._adapters)

    def _unknown_message(self, model: str) -> str:
        choices = ", ".join(repr(m) for m in self.model_names())
        return f"The model {model!r} does not exist here. Use one of: {choices}."
