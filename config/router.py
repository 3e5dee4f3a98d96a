"""Configuration of the router: routes, tiers and API keys.

`ClusterConfig` embeds these as its fields `router`, `tiers` and `api_keys`; the `router/`
package reads them and nothing else. Every field has a default, so an empty section gives a
working development setup: three routes (coding, reasoning, chat) to pools of the same names,
three tiers (premium, standard, free) and no API keys (open mode).
"""

import hashlib
import re
from collections.abc import Collection
from pathlib import Path
from typing import Annotated

import re2
from pydantic import AfterValidator, Field, SecretStr, field_validator, model_validator

from raylane.config.base import StrictModel

AUTO_MODELS = ("auto", "raylane-auto")  # model names that ask the semantic classifier to choose
BUILTIN_DATASET = "builtin"  # RouterConfig.dataset value naming router/dataset/train.tsv
FOLLOWUP_LABEL = "followup"  # the classifier's internal class of context-dependent turns; not a route name


def compile_route_regex(pattern: str) -> re2._Regexp:
    """A `routes[].regex` pattern as the router runs it: RE2 (linear time in the text, whatever the
    pattern), multiline. Raises `re2.error` for what RE2 cannot run: backreferences, lookarounds,
    possessive or atomic groups, repetitions past 1000, programs too large."""
    options = re2.Options()
    options.log_errors = False  # the error is raised, and named in the config error
    return re2.compile(f"(?m){pattern}", options)


class RouteConfig(StrictModel):
    """One kind of traffic and the pools that serve it, in order of preference."""

    name: str = Field(min_length=1, description="route name, reported in the x-raylane-route header")
    pool: str = Field(min_length=1, description="pool that serves this route first")
    fallbacks: list[str] = Field(
        default_factory=list, description="pools tried in this order when `pool` cannot serve a request"
    )
    examples: list[str] = Field(
        default_factory=list,
        description="example prompts of this route, learned in addition to the labelled `dataset`",
    )
    keywords: list[str] = Field(
        default_factory=list,
        description="words or phrases (case-insensitive, whole words) that send the latest user turn here",
    )
    regex: list[str] = Field(
        default_factory=list,
        description="regular expressions (multiline) sending the latest user turn here, in RE2 syntax "
        "(linear time: no backreferences or lookarounds; `\\w`, `\\d`, `\\b` are ASCII, `\\p{L}` is any "
        "letter); read on the first and last 4096 characters of the turn",
    )

    @field_validator("regex")
    @classmethod
    def _compiles(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            try:
                compile_route_regex(pattern)
            except re2.error as e:
                reason = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else e
                raise ValueError(
                    f"{pattern!r} is not a regular expression the router can run (RE2 syntax, linear "
                    f"time: no backreferences or lookarounds): {reason}"
                ) from None
        return patterns

    @model_validator(mode="after")
    def _fallbacks_differ(self) -> "RouteConfig":
        if self.pool in self.fallbacks:
            raise ValueError(f"fallbacks: pool {self.pool!r} is this route's own pool")
        if len(set(self.fallbacks)) != len(self.fallbacks):
            raise ValueError(f"fallbacks: {self.fallbacks} names a pool twice")
        return self


class ConversationWeights(StrictModel):
    """How a chat's system prompt and earlier user turns count next to its latest user turn.

    The classifier also learns what a turn that needs its conversation looks like ("any hints?",
    "make it shorter", "what about the other case?"). The latest turn's own route evidence counts
    in proportion to how self-contained it is; the rest comes from the context, the parts' route
    scores averaged with these weights. So a clear request is never overruled by its context, a
    vague one is settled by it, and a generic system prompt does not pull clear requests to chat.
    """

    system: float = Field(1.0, ge=0, description="weight of the system prompt(s) in the context")
    earlier_user: float = Field(1.0, ge=0, description="weight of the user turn before the latest one")
    decay: float = Field(0.5, ge=0, le=1, description="each older user turn weighs this times the next newer")
    max_earlier_turns: int = Field(3, ge=0, description="earlier user turns read at most (newest first)")


class CircuitBreakerConfig(StrictModel):
    """When a failing pool is taken out of its routes' fallback chains, and for how long."""

    failure_threshold: int = Field(5, ge=1, description="consecutive failures that open a pool's circuit")
    cooldown_s: float = Field(
        30.0, gt=0, description="seconds an open circuit rejects traffic before one probe request"
    )


def default_routes() -> list[RouteConfig]:
    code_shapes = [
        r"```",  # a fenced block: code or a log pasted in
        r"^\s*(def|class|async def)\s+\w+.*:\s*$",  # a Python definition
        r"^\s*(#include\s*<|import\s+[\w.]+\s*;|package\s+[\w.]+\s*;|using\s+System)",
        r"^\s*(public|private|protected)\s+(static\s+)?[\w<>\[\]]+\s+\w+\s*\(",
        r"^Traceback \(most recent call last\):",
    ]
    return [
        RouteConfig(name="coding", pool="coding", fallbacks=["reasoning", "chat"], regex=code_shapes),
        RouteConfig(name="reasoning", pool="reasoning", fallbacks=["chat"]),
        RouteConfig(name="chat", pool="chat", fallbacks=["reasoning"]),
    ]


def _unique_names(items: list, field: str) -> None:
    names = [item.name for item in items]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"{field}: names must be unique, {duplicates} repeat")


class AffinityConfig(StrictModel):
    """Conversation affinity for `auto`: a conversation's later turns go to the pool its earlier turns
    were served by, without asking the classifier again (deployments/gateway/affinity.py)."""

    enabled: bool = Field(True, description="Keep each `auto` conversation on one pool.")
    ttl_s: float = Field(
        3600.0, gt=0, description="A conversation not heard from for this long is classified afresh."
    )
    max_conversations: int = Field(
        100_000, ge=1, description="Conversations each gateway replica remembers (the least recent go first)."
    )


class RouterConfig(StrictModel):
    """The semantic classifier, routes, fallback and admission settings."""

    routes: list[RouteConfig] = Field(
        default_factory=default_routes,
        min_length=1,
        description="where `auto` may send a request: each route names its pool and fallback chain",
    )
    default_route: str = Field("chat", description="route for `auto` requests the classifier is unsure of")
    confidence_threshold: float = Field(
        0.45, ge=0, le=1, description="below this classifier probability, `auto` goes to `default_route`"
    )
    dataset: str | None = Field(
        BUILTIN_DATASET,
        description="labelled prompts (TSV `route<TAB>text`) the classifier learns from; "
        "'builtin' = the project's router/dataset/train.tsv, null = only the routes' `examples`",
    )
    weights: ConversationWeights = Field(
        default_factory=ConversationWeights, description="how much each part of a conversation weighs"
    )
    max_tokens: int = Field(
        128, ge=16, le=256, description="embedding-model tokens read per message (head and tail of long text)"
    )
    quantize: bool = Field(True, description="int8 dynamic quantization of the classifier's linear layers")
    circuit_breaker: CircuitBreakerConfig = Field(
        default_factory=CircuitBreakerConfig, description="when a failing pool is skipped, and for how long"
    )
    affinity: AffinityConfig = Field(
        default_factory=AffinityConfig, description="keeping an `auto` conversation on one pool"
    )
    default_max_in_flight: int = Field(
        64,
        ge=1,
        description="requests the gateway sends a pool at once unless the pool sets its own "
        "(`pools[].max_in_flight`), or more when its replicas take more: max_replicas x "
        "max_ongoing_requests",
    )
    default_max_waiting: int = Field(
        256, ge=0, description="requests that may wait for one pool (all tiers) unless the pool sets its own"
    )
    overflow: bool = Field(
        False,
        description="a pool busier than the tier may wait hands the request on to the next pool of its "
        "route's fallback chain; false: it gets 429 with Retry-After, and fallback is for outages only "
        "(a peak on one pool then never spreads into the others)",
    )
    max_tokens_estimate: int = Field(
        1024,
        ge=1,
        description="tokens a request that sets no max_tokens is charged up front per choice against "
        "its key's tokens/min (settled with the real usage when it ends)",
    )
    fallback_for_named_models: bool = Field(
        True, description="requests naming a pool or model also fall back along that pool's route"
    )

    @model_validator(mode="after")
    def _routes_consistent(self) -> "RouterConfig":
        _unique_names(self.routes, "routes")
        names = [r.name for r in self.routes]
        if FOLLOWUP_LABEL in names:
            raise ValueError(f"routes: {FOLLOWUP_LABEL!r} is reserved for the classifier's follow-up turns")
        if self.default_route not in names:
            raise ValueError(f"default_route: {self.default_route!r} is not a route (routes: {names})")
        if self.dataset not in (None, BUILTIN_DATASET) and not Path(self.dataset).is_file():
            raise ValueError(f"dataset: {self.dataset!r} is not a file")
        return self

    def route(self, name: str) -> RouteConfig:
        return next(r for r in self.routes if r.name == name)

    def check_pools(self, pool_names: Collection[str]) -> None:
        """Raise ValueError naming the field when a route names a pool the cluster does not have."""
        for i, route in enumerate(self.routes):
            for field_name, pools in (("pool", [route.pool]), ("fallbacks", route.fallbacks)):
                missing = [p for p in pools if p not in pool_names]
                if missing:
                    raise ValueError(
                        f"router.routes[{i}].{field_name}: no pool is named {missing[0]!r} "
                        f"(pools: {sorted(pool_names)})"
                    )


class TierConfig(StrictModel):
    """A class of service: how soon its requests are served and how much it may use."""

    name: str = Field(min_length=1, description="tier name, named by API keys and reported in x-raylane-tier")
    priority: int = Field(ge=0, description="lower is served first, as in vLLM; passed to the engine")
    requests_per_minute: int | None = Field(
        None,
        ge=1,
        description="per API key, for the cluster (each gateway replica enforces its 1/num_replicas); "
        "null = unlimited",
    )
    tokens_per_minute: int | None = Field(
        None,
        ge=1,
        description="prompt + generated tokens per API key, for the cluster (as requests_per_minute), "
        "charged up front (prompt estimate + max_tokens x n) and settled with the real usage; "
        "null = unlimited",
    )
    max_queue_depth: int = Field(64, ge=0, description="requests of this tier that may wait for one pool")
    max_queue_wait_s: float = Field(10.0, ge=0, description="longest a request may wait for a pool slot")
    sheddable: bool = Field(
        False,
        description="when a pool's wait queue is full, a waiting request of this tier is dropped (429) "
        "to make room for one of a higher-priority tier",
    )
    max_pool_share: float = Field(
        1.0,
        gt=0,
        le=1,
        description="share of each pool's slots this tier's requests may hold at once (at least one); "
        "below 1 keeps the rest free for other tiers, so a flood of this tier never makes them wait",
    )
    max_concurrent_per_key: int | None = Field(
        None,
        ge=1,
        description="requests one API key may have held or waiting in all pools at once, for the "
        "cluster (each gateway replica enforces its 1/num_replicas, rounded up); 429 past it, even "
        "with slots free; null = no cap: a key alone may use all its tier may, and keys of a tier "
        "share a busy pool's slots by taking turns",
    )
    admin: bool = Field(
        False,
        description="keys of this tier may load and unload LoRA adapters at run time "
        "(POST /v1/load_lora_adapter, /v1/unload_lora_adapter)",
    )
    batches: bool = Field(
        False,
        description="keys of this tier may upload files and run batches (/v1/files, /v1/batches); "
        "off: a 403. Batch lines then run as the `batch` tier, below every tier",
    )
    batch_tokens_per_minute: int | None = Field(
        None,
        ge=1,
        description="prompt + generated tokens per minute of one key's batch lines (a bucket apart from "
        "its interactive `tokens_per_minute`, charged and settled the same way): a line past it waits "
        "for it; null = unlimited",
    )


def default_tiers() -> list[TierConfig]:
    return [
        TierConfig(name="premium", priority=0, max_queue_depth=256, max_queue_wait_s=30.0, batches=True),
        TierConfig(
            name="standard",
            priority=1,
            requests_per_minute=120,
            tokens_per_minute=200_000,
            max_queue_depth=128,
            max_queue_wait_s=10.0,
            batches=True,
            batch_tokens_per_minute=200_000,
        ),
        TierConfig(
            name="free",
            priority=2,
            requests_per_minute=20,
            tokens_per_minute=20_000,
            max_queue_depth=16,
            max_queue_wait_s=2.0,
            sheddable=True,
            max_pool_share=0.75,
        ),
    ]


KEY_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def key_digest(key: str) -> str:
    """`sha256:<hex>` of an API key as a config writes it (a digest already: itself)."""
    if KEY_DIGEST.fullmatch(key):
        return key
    return "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()


def open_tier() -> TierConfig:
    """Open mode's tier unless `api_keys.default_tier` names one: no rate limits, and requests wait
    for a pool (up to its own `max_waiting`) rather than being turned away, as vLLM's server queues
    them: a benchmark or an eval tool run against a local server gets answers, not floods of 429."""
    return TierConfig(
        name="open", priority=1, max_queue_depth=1_000_000, max_queue_wait_s=600.0, batches=True
    )


def _check_tiers(tiers: list[TierConfig]) -> list[TierConfig]:
    if not tiers:
        raise ValueError("at least one tier is needed")
    _unique_names(tiers, "tiers")
    return tiers


# The type of `ClusterConfig.tiers`: a list of tiers with unique names.
Tiers = Annotated[list[TierConfig], AfterValidator(_check_tiers)]


class ApiKeysConfig(StrictModel):
    """Where API keys come from; each key maps to a tier. No key anywhere = open development mode.

    A key file (or the env var) holds one `key tier` or `key:tier` per line, `#` starts a comment:
    the shape of a Kubernetes Secret mounted as a file. Keys are compared in constant time and
    never logged; a request's tier comes only from its key.
    """

    keys: dict[SecretStr, str] = Field(
        default_factory=dict,
        description="inline keys: key -> tier name; a key may be written as its digest, "
        "`sha256:<64 hex digits>` of the key, so the config holds no key",
    )
    env: str | None = Field(None, description="environment variable holding keys, same format as `file`")
    file: str | None = Field(None, description="path of a key file, e.g. a mounted Kubernetes Secret")
    default_tier: str | None = Field(
        None,
        description="tier of every request in open mode (no keys); null: the built-in `open` tier, "
        "without rate limits (one local user: a developer, a benchmark or eval run), as vLLM's server. "
        "Name a limited tier for a cluster others can reach",
    )

    def with_digests(self) -> "ApiKeysConfig":
        """These keys as their digests (`key_digest`): what a record of the config may hold."""
        keys = {SecretStr(key_digest(k.get_secret_value())): tier for k, tier in self.keys.items()}
        return self.model_copy(update={"keys": keys})

    def check_tiers(self, tier_names: list[str]) -> None:
        """Raise ValueError naming the field when a key or the default refers to an unknown tier."""
        if self.default_tier is not None and self.default_tier not in tier_names:
            raise ValueError(f"api_keys.default_tier: no tier is named {self.default_tier!r} ({tier_names})")
        for tier in self.keys.values():
            if tier not in tier_names:
                raise ValueError(f"api_keys.keys: no tier is named {tier!r} ({tier_names})")
