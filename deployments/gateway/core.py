"""The gateway's core, under every API surface (deployments/gateway/routes/): authenticate, charge,
check a grammar.

Per request: authenticate the API key (-> tier; 401), read the body's bytes (413 past the limit),
charge the tier's rate limit (429) one request and the prompt's estimate from the byte count before
any work whose cost the client controls, parse and validate the body (any mistake -> 400 naming the
parameter), charge max_tokens x n (429), resolve `model` with the router (a pool's name or served
id, or `auto` / `raylane-auto` -> the semantic classifier's route; 404), then hand it to the
`Dispatcher` (deployments/gateway/dispatch.py): a slot in the first pool of the route's fallback chain that
can serve, the pool's first item, fallback before it and relay after it. The charge is settled with
the tokens used when the response ends; a request refused on the way is settled with none.
Responses carry `x-raylane-route`, `-pool`, `-tier` and, where they apply, `-fallback`,
`-decision` and `-adapter`.
While the app drains before shutdown (deployments/gateway/drain.py), new requests get 503 with
Retry-After and /health says "draining"; the requests in flight finish.
"""

from typing import Any

from fastapi import Request

from raylane import tracing
from raylane.bounded_worker import BoundedWorker, WorkerBusy, WorkerStarved, WorkerTimeout
from raylane.config import ClusterConfig
from raylane.deployments.gateway.dispatch import Dispatcher
from raylane.deployments.gateway.drain import DrainWatcher
from raylane.deployments.gateway.lora_adapters import LoRAAdapters
from raylane.deployments.gateway.pool_health import PoolHealth
from raylane.deployments.gateway.request_body import read_body
from raylane.deployments.gateway.request_record import current_record
from raylane.deployments.protocol.errors import OpenAIError, invalid
from raylane.deployments.protocol.sampling import grammar_param
from raylane.router import Principal, RateCharge, Router, RouterError
from raylane.router.errors import OverloadedError

# What the gateway's grammar-check workers import (deployments/protocol/sampling.py builds the grammars,
# xgrammar checks them): the gateway process itself imports neither xgrammar nor torch.
GRAMMAR_PRELOAD = ("raylane.deployments.protocol.sampling", "xgrammar")
# The prompt's token estimate charged before the body is parsed: JSON text runs about four bytes a
# token in the tokenizers raylane serves; settled with the real count when the request ends.
PROMPT_BYTES_PER_TOKEN = 4


class Draining(OpenAIError):
    def __init__(self) -> None:
        super().__init__(
            "The server is shutting down and takes no new requests; retry shortly.",
            status=503,
            code="draining",
        )


class GatewayCore:
    """What every surface's routes call on `self`, the `Gateway` replica (deployments/gateway/ingress.py
    builds and reconfigures the state declared here)."""

    config: ClusterConfig
    router: Router
    pools: dict[str, Any]  # pool name -> its DeploymentHandle
    lora: LoRAAdapters
    drain: DrainWatcher
    pool_health: PoolHealth
    dispatcher: Dispatcher
    grammar_worker: BoundedWorker | None
    config_generation: int | None

    def check_open(self) -> None:
        self.pool_health.watch()
        self.lora.watch()
        self.drain.start()
        if self.drain.draining:
            raise Draining()

    def authenticate(self, request: Request) -> Principal:
        self.check_open()
        if (record := current_record()) is not None:
            record.config_generation = self.config_generation
        with tracing.span("gateway.authenticate") as span:
            principal = self.router.authenticate(
                request.headers, request.client.host if request.client else None
            )
            # The key's id ("key-<digest prefix>"), never the key.
            attributes = {"raylane.tier": principal.tier.name, "raylane.api_key.id": principal.key_id}
            tracing.set_attributes(span, **attributes)
        return principal

    def may_see_internals(self, request: Request) -> bool:
        """Open mode, or a valid API key: /health's details (pool names, loads) are for callers."""
        try:
            self.router.authenticate(request.headers)
        except RouterError:
            return False
        return True

    async def read_charged(self, request: Request, principal: Principal) -> bytes:
        """The body's bytes (413 past the limit), charged to the key's rate limit before anything
        reads them: one request and the prompt's estimate, `PROMPT_BYTES_PER_TOKEN` bytes a token
        (429 when over it). A body with a Content-Length is charged on it before a byte is read, so
        a key that cannot afford its body, or is over its limit already, costs this replica a
        look-up (Serve's proxy then never forwards the body either); a chunked body is charged once
        read, within the byte limit."""
        max_bytes = self.config.gateway.max_request_body_bytes
        declared = request.headers.get("content-length", "")
        charged_first = declared.isdigit() and int(declared) <= max_bytes  # (HTTP/1.1 framing holds it)
        with tracing.span("gateway.rate_limit"):
            self.router.precheck_rate(principal)  # a key over its limits: 429 without reading its body
            if charged_first:
                charge = self.router.check_rate(principal, int(declared) // PROMPT_BYTES_PER_TOKEN)
                request.state.rate_charge = charge
        with tracing.span("gateway.read_body") as span:
            body = await read_body(request, max_bytes)
            tracing.set_attributes(span, **{"http.request.body.size": len(body)})
        if not charged_first:
            with tracing.span("gateway.rate_limit"):
                charge = self.router.check_rate(principal, len(body) // PROMPT_BYTES_PER_TOKEN)
                request.state.rate_charge = charge
        return body

    def charge_output(self, principal: Principal, charge: RateCharge, max_tokens: int | None, n: int) -> None:
        """Charge what the request may generate, `max_tokens` x `n` (`router.max_tokens_estimate` a
        choice without max_tokens), up front; 429 when the key's tokens/min cannot cover it."""
        per_choice = max_tokens if max_tokens is not None else self.config.router.max_tokens_estimate
        self.router.charge_more(principal, charge, per_choice * n)

    async def prepare(self, fn, req, principal: Principal):
        """`fn(req)`: the request's sampling parameters. With a grammar (a schema, regex, EBNF, tool
        definitions) the checks and builds that can take exponential time run in a bounded worker
        process: past `gateway.grammar_check_timeout_s` the request gets a 400 naming the field and this event
        loop never waited on it; when the worker's queue, or the key's share of it, is full, a 429
        with Retry-After at once, and the same when the machine was too busy to give the check its
        time (WorkerStarved). Without one, here (microseconds)."""
        param = grammar_param(req)
        if param is None:
            return fn(req)
        if self.grammar_worker is None:
            self.grammar_worker = BoundedWorker(
                timeout_s=self.config.gateway.grammar_check_timeout_s, preload=GRAMMAR_PRELOAD
            )
        try:
            with tracing.span("gateway.grammar_check", **{"raylane.grammar_param": param}):
                return await self.grammar_worker.run(fn, req, key=principal.key_id)
        except WorkerBusy as e:
            raise OverloadedError(
                f"The grammar in '{param}' cannot be checked now: {e}. Retry later, or send fewer at once.",
                retry_after=e.retry_after,
                reason="grammar_starved" if isinstance(e, WorkerStarved) else "grammar_queue",
            ) from None
        except WorkerTimeout as e:
            raise invalid(
                param,
                f"Invalid '{param}': too complex: checking it was stopped, {e}. Simplify the schema, "
                "regex or grammar (nesting, alternatives, repetition counts).",
                code="grammar_too_complex",
            ) from None
