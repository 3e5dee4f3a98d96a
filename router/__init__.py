"""The router: which pool serves a request, for whom, when, and what to do when that pool can't.

Plain Python (no Ray): the gateway owns one `Router` per replica and calls, per request,

    principal = router.authenticate(request.headers, client=request.client.host)   # 401
    charge = router.check_rate(principal, estimate_tokens(body_bytes))             # 429 rate limit
    router.charge_more(principal, charge, max_tokens * n)                          # 429, once parsed
    resolution = await router.resolve_async(body.model, messages)                  # 404 unknown model
    plan = router.plan(principal, resolution, charge=charge)                       # (charges if no charge)
    slot = await plan.next_slot()                                                  # 429 busy / 503 / 400
    ... send to slot.pool with priority=plan.priority; on an error before the first token:
        slot.failed(); slot = await plan.next_slot()                               # fallback
    ... when the stream ends: slot.succeeded() (or slot.failed() / slot.abandoned())
    response headers: plan.headers();  afterwards: plan.charge.settle(used_tokens)

The rate limit comes first, before any work whose cost the client controls (parsing, the
classifier, grammars): a key over its limit costs a bucket look-up.

Every error raised is a `raylane.router.errors.RouterError` with `.status`, `.to_openai()` and `.headers()`.
"""

import asyncio
import os
import time
from collections.abc import Callable, Mapping, Sequence

from raylane.config import AUTO_MODELS, ApiKeysConfig, RouterConfig, TierConfig
from raylane.router.admission import AdmissionController, PoolLoad
from raylane.router.classifier import RouteDecision, SemanticClassifier
from raylane.router.dispatch import DispatchPlan, Slot
from raylane.router.errors import RouterError
from raylane.router.fallback import CircuitBreaker, CircuitState, FallbackChain, FallbackReason
from raylane.router.rate_limit import RateCharge, RateLimiter
from raylane.router.resolve import ModelResolver, PoolSpec, Resolution
from raylane.router.tiers import ApiKeyAuthenticator, Principal

__all__ = [
    "FallbackReason",
    "PoolSpec",
    "Principal",
    "Resolution",
    "RateCharge",
    "RouteDecision",
    "Router",
    "RouterError",
    "Slot",
    "DispatchPlan",
]


class Router:
    def __init__(
        self,
        config: RouterConfig,
        tiers: Sequence[TierConfig],
        api_keys: ApiKeysConfig,
        pools: Sequence[PoolSpec],
        *,
        classifier: SemanticClassifier | None = None,
        clock: Callable[[], float] = time.monotonic,
        environ: Mapping[str, str] = os.environ,
    ):
        """Validates the config against `pools` (ValueError naming the field) and loads the
        classifier (seconds; pass one to share it). `clock` drives rate limits, waits and breakers."""
        self.config = config
        self.pools = {p.name: p for p in pools}
        config.check_pools(list(self.pools))
        self.classifier = classifier if classifier is not None else SemanticClassifier(config)
        self.authenticator = ApiKeyAuthenticator(api_keys, list(tiers), environ=environ, clock=clock)
        self.rate_limiter = RateLimiter(clock)
        self.admission = AdmissionController(clock)
        self.breakers: dict[str, CircuitBreaker] = {}
        self._healthy: dict[str, bool] = {}
        breaker = config.circuit_breaker
        for pool in pools:
            self.admission.add_pool(pool.name, *_limits(config, pool))
            self.breakers[pool.name] = CircuitBreaker(breaker.failure_threshold, breaker.cooldown_s, clock)
            self._healthy[pool.name] = True
        self.resolver = ModelResolver(config, pools, self.classifier.classify)

    def update(
        self,
        config: RouterConfig,
        tiers: Sequence[TierConfig],
        api_keys: ApiKeysConfig,
        pools: Sequence[PoolSpec],
        *,
        classifier: SemanticClassifier | None = None,
        environ: Mapping[str, str] = os.environ,
    ) -> None:
        """Take a new config in place (a live `raylane apply`), keeping what requests in flight hold:
        their slots, waits and charges, each key's rate-limit spending, and the circuit breakers and
        health of the pools that stay. Checked and built first, so an invalid config changes nothing
        (ValueError naming the field). `classifier`: the new routes' one, when they differ."""
        specs = {p.name: p for p in pools}
        config.check_pools(list(specs))
        authenticator = ApiKeyAuthenticator(
            api_keys, list(tiers), environ=environ, clock=self.admission.clock
        )
        classifier = classifier if classifier is not None else self.classifier
        resolver = ModelResolver(config, pools, classifier.classify)
        # Nothing below can fail: the switch is whole.
        breaker = config.circuit_breaker
        for pool in pools:
            if pool.name in self.pools:
                self.admission.resize(pool.name, *_limits(config, pool))
            else:
                self.admission.add_pool(pool.name, *_limits(config, pool))
                self.breakers[pool.name] = CircuitBreaker(
                    breaker.failure_threshold, breaker.cooldown_s, self.admission.clock
                )
                self._healthy[pool.name] = True
        self.rate_limiter.retier(tiers)
        # A pool taken out keeps its admission entry and breaker for the requests still on it; no
        # route or model name resolves to it any more.
        self.config, self.pools, self.classifier = config, specs, classifier
        self.authenticator, self.resolver = authenticator, resolver

    @property
    def open_mode(self) -> bool:
        return self.authenticator.open_mode

    def authenticate(self, headers: Mapping[str, str], client: str | None = None) -> Principal:
        """The caller's tier from its API key; AuthenticationError (401) when keys are required."""
        return self.authenticator.authenticate(headers, client)

    def tier_of_key(self, key_id: str) -> TierConfig | None:
        """The tier of the API key with id `key_id` now; None once the key is gone."""
        return self.authenticator.tier_of(key_id)

    def resolve(self, model: str, messages: list[dict]) -> Resolution:
        """Route and candidate pools for `model` (pool name, served model id, `auto`/`raylane-auto`).
        Classifying takes milliseconds of CPU: from async code prefer `resolve_async`."""
        return self.resolver.resolve(model, messages)

    async def resolve_async(self, model: str, messages: list[dict]) -> Resolution:
        if model in AUTO_MODELS:  # the classifier's forward pass runs off the event loop
            return await asyncio.to_thread(self.resolve, model, messages)
        return self.resolve(model, messages)

    def plan(
        self,
        principal: Principal,
        resolution: Resolution,
        *,
        prompt_tokens: int | None = None,
        charge: RateCharge | None = None,
        sequences: int = 1,
    ) -> DispatchPlan:
        """Prepare the walk down the candidate pools. Without `charge` (the rate limit charged
        earlier by `check_rate`), charge it now (RateLimitError, 429); with one, nothing twice.
        `sequences`: what the request runs in the engine (n x prompts), counted against its tier's
        `max_pool_share`."""
        if charge is None:
            charge = self.rate_limiter.check(principal.key_id, principal.tier, prompt_tokens or 0)
        chain = FallbackChain(
            resolution.pools,
            self.breakers,
            is_healthy=lambda pool: self._healthy[pool],
            fits=lambda pool: _fits(self.pools[pool], prompt_tokens),
        )
        deadline = self.admission.clock() + principal.tier.max_queue_wait_s
        return DispatchPlan(
            resolution,
            principal,
            chain,
            self.admission,
            self.breakers,
            deadline,
            charge,
            self.config.overflow,
            sequences=sequences,
        )

    def check_rate(self, principal: Principal, tokens: int = 0) -> RateCharge:
        """Charge one request and `tokens` (an estimate) to the key's rate limits, or RateLimitError
        (429) charging nothing. Settle the charge with the tokens used when the request ends."""
        return self.rate_limiter.check(principal.key_id, principal.tier, tokens)

    def precheck_rate(self, principal: Principal) -> None:
        """429 at once for a key that could not send any request now (over its rate limits, or at its
        tier's `max_concurrent_per_key`); charges nothing. The gateway asks before reading a body."""
        self.rate_limiter.precheck(principal.key_id, principal.tier)
        self.admission.check_key_cap(principal.tier, principal.key_id)

    def charge_more(self, principal: Principal, charge: RateCharge, tokens: int) -> None:
        """Add `tokens` (what the request may generate: max_tokens x n) to its charge, or 429."""
        self.rate_limiter.charge_more(charge, principal.key_id, principal.tier, tokens)

    def set_pool_healthy(self, pool: str, healthy: bool) -> None:
        """From the gateway's view of the pool's replicas: False = no healthy replica, skip it."""
        self._healthy[pool] = healthy

    def set_pool_capacity(self, pool: str, max_in_flight: int) -> None:
        self.admission.set_capacity(pool, max_in_flight)

    def pool_load(self, pool: str) -> PoolLoad:
        return self.admission.load(pool)

    def others_on(self, pool: str, tier: str) -> bool:
        """Whether requests of other tiers than `tier` hold or wait for slots of `pool`."""
        load = self.admission.load(pool)
        return load.waiting > 0 or load.in_flight > self.admission.held(pool, tier)

    def circuit_state(self, pool: str) -> CircuitState:
        return self.breakers[pool].state

    def model_names(self) -> list[str]:
        return self.resolver.model_names()


def _limits(config: RouterConfig, pool: PoolSpec) -> tuple[int, int]:
    """(requests the pool takes at once, requests that may wait for it)."""
    max_waiting = config.default_max_waiting if pool.max_waiting is None else pool.max_waiting
    return pool.max_in_flight or max(config.default_max_in_flight, pool.replica_capacity), max_waiting


def _fits(pool: PoolSpec, prompt_tokens: int | None) -> bool:
    """A prompt fits when at least one token can still be generated after it."""
    return prompt_tokens is None or pool.max_context_len is None or prompt_tokens < pool.max_context_len
