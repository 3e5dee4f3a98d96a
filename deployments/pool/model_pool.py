"""A model pool replica: one `AsyncLLM` serving OpenAI chat and completions to the gateway.

`raylane.deployments.app` wraps this class with `serve.deployment` and the pool's options: a placement
group with one bundle per rank, so at tensor-parallel size > 1 the engine's Ray executor starts its
rank actors inside the replica's own bundles (as Ray Serve LLM does); at size 1 the engine runs in
this process. The class itself does not import Serve, so it runs (and is tested) without it.

The module imports nothing heavy: a new replica starts its engine core process first, and only then
imports torch, xgrammar and its serving code, while the core imports its own and loads the model
(two start-ups at once on two cores: `raylane bench recovery` in bench/README.md).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from operator import methodcaller
from pathlib import Path
from typing import TYPE_CHECKING

from raylane import tracing
from raylane.config import EngineConfig, PoolConfig, TracingConfig
from raylane.deployments.pool.pool_span import end_pool_span, start_pool_span
from raylane.engine.core_launch import CoreLaunch, launch_core
from raylane.engine.lora import LoRARequest, adapter_id

if TYPE_CHECKING:
    from raylane.deployments.protocol.tokenization_schemas import DetokenizeRequest, TokenizeRequest
    from raylane.deployments.protocol.wire import PoolItem, PoolRequest

logger = logging.getLogger(__name__)
HEALTH_PROBE_TIMEOUT_S = 10.0
MAX_ADAPTER_NAMES = 1024  # adapter ids this replica remembers the names of (for its routing stats)


class ModelPool:
    def __init__(
        self,
        pool: PoolConfig | dict,
        prepare_engine_config: Callable[[PoolConfig], EngineConfig] = PoolConfig.engine_config,
        tracing_config: TracingConfig | dict | None = None,
    ):
        """`prepare_engine_config` finds the pool's checkpoint on this replica's node (the app builder
        passes `raylane.models.sources.prepare_engine_config`, which also writes a demo checkpoint a
        fresh node lacks); the default takes the pool's `model` as a path. `tracing_config`: the
        cluster's `observability.tracing` (this process and its engine core trace with it)."""
        started = time.time()
        self.pool = PoolConfig.model_validate(pool)
        self.adapter_names: dict[int, str] = {}  # LoRA adapter id -> the name it was asked for by
        settings = TracingConfig.model_validate(tracing_config or {}).model_dump()
        tracing.configure(settings, f"pool:{self.pool.name}:{_replica_name()}")  # before the core starts
        config = prepare_engine_config(self.pool)
        logger.info("pool %s: loading %s", self.pool.name, config.model)
        launch = launch_core(config) if config.uses_core_process else None
        try:
            self._start(config, launch, started)
        except BaseException:
            if launch is not None and getattr(self, "llm", None) is None:
                launch.cancel()
            raise

    def _start(self, config: EngineConfig, launch: CoreLaunch | None, started: float) -> None:
        from raylane.bounded_worker import start_forkserver
        from raylane.deployments.metrics.pool import MeteredLLM, PoolMetrics
        from raylane.deployments.metrics.reporter import MetricsReporter
        from raylane.deployments.pool.serving_chat import OpenAIServingChat
        from raylane.deployments.pool.serving_completion import OpenAIServingCompletion
        from raylane.deployments.pool.serving_responses import OpenAIServingResponses
        from raylane.deployments.pool.serving_tokenization import OpenAIServingTokenization
        from raylane.engine import AsyncLLM
        from raylane.engine.grammar_compiler import (
            COMPILE_PRELOAD,
            GrammarCompileService,
            tokenizer_info_json,
        )

        self.llm = AsyncLLM(config, core_launch=launch)
        engine_ready = time.time()
        self.metrics = PoolMetrics(self.pool.name, self.pool.model_id)
        self.reporter = MetricsReporter(self.metrics, self._gauges)
        metered = MeteredLLM(self.llm, self.metrics)
        self.grammar = None
        if not config.simulated:  # which runs no grammars: no worker, whose forkserver imports torch
            # A client's grammar compiles in a worker process, bounded in time, not on the engine loop.
            self.grammar = GrammarCompileService(
                lambda: self.llm.run_in_engine(tokenizer_info_json), self.pool.grammar_compile_timeout_s
            )
            start_forkserver(COMPILE_PRELOAD)  # its worker's imports, now rather than for the first grammar
        args = (metered, self.pool.model_id, self.llm.max_model_len, self.grammar)
        self.chat_serving = OpenAIServingChat(*args)
        self.completion_serving = OpenAIServingCompletion(*args)
        sanitize = self.pool.sanitize_control_tokens
        self.tokenization = OpenAIServingTokenization(self.llm.tokenizer, *args[1:3], sanitize)
        self.responses_serving = OpenAIServingResponses(self.chat_serving, self.pool.reasoning_parser)
        self.chat_serving.reasoning_parser = self.pool.reasoning_parser
        self.chat_serving.sanitize_control_tokens = sanitize
        # Wall-clock times (comparable across this machine's processes) for `raylane bench recovery`.
        self.startup = {
            "pid": os.getpid(),
            "init": started,
            "engine_ready": engine_ready,
            "ready": time.time(),
        }
        logger.info(
            "pool %s: replica ready in %.1fs (engine %.1fs)",
            self.pool.name, self.startup["ready"] - started, engine_ready - started,
        )  # fmt: skip

    async def chat(self, request: PoolRequest) -> AsyncIterator[PoolItem]:
        """The engine schedules by `request.priority` (the caller's tier's; lower is served first),
        then by `request.tenant` (the caller's key: fair shares within a priority).
        The response's last item is a `FinalItem` with the request's `RequestSummary` (tokens, TTFT,
        finish reason) for the request log (deployments/protocol/wire.py). `request.resume`: continue a
        stream that a failed replica began (deployments/gateway/resumption.py)."""
        r = request
        items = self.chat_serving.chat(
            r.body,
            r.params,
            r.tools,
            r.request_id,
            r.priority,
            r.resume,
            r.tenant,
            self._lora(r),
            r.cache_salt,
        )
        async for item in self._forward(items, request):
            yield item

    async def completions(self, request: PoolRequest) -> AsyncIterator[PoolItem]:
        r = request
        items = self.completion_serving.completion(
            r.body, r.params, r.request_id, r.priority, r.resume, r.tenant, self._lora(r), r.cache_salt
        )
        async for item in self._forward(items, request):
            yield item

    async def responses(self, request: PoolRequest) -> AsyncIterator[PoolItem]:
        """/v1/responses: the chat request the gateway made of it, answered as a Responses object or
        its events; `request.echo` holds the request's fields the response repeats."""
        r = request
        items = self.responses_serving.create(
            r.body,
            r.params,
            r.tools,
            r.request_id,
            r.echo,
            r.priority,
            r.resume,
            r.tenant,
            self._lora(r),
            r.cache_salt,
        )
        async for item in self._forward(items, request):
            yield item

    def _lora(self, request: PoolRequest) -> LoRARequest | None:
        """The engine's request for the adapter the gateway named: its directory in this pool, and
        an id made of name and directory, so every replica gives an adapter the same id and one
        loaded again from another directory gets another (the engine keys slots and cached
        blocks by id)."""
        if request.adapter is None:
            return None
        name, path = request.adapter.name, request.adapter.path(self.pool.name)
        lora = LoRARequest(name, adapter_id(name, path), path)
        self.adapter_names[lora.lora_int_id] = name
        while len(self.adapter_names) > MAX_ADAPTER_NAMES:  # ids of adapters long unloaded
            del self.adapter_names[next(iter(self.adapter_names))]
        return lora

    async def check_adapter(self, lora_path: str, roots: list[str]) -> str:
        """What running the adapter at `lora_path` would fail on (`POST /v1/load_lora_adapter` asks
        before it serves one): a 400 naming `lora_path`. Its path resolved here, where the files are
        (symlinks included), must lie in one of `roots`; the answer is that path as JSON, which the
        gateway records, so a link changed later redirects nothing."""
        from raylane.deployments.protocol.errors import invalid

        resolved = await asyncio.to_thread(lambda: Path(lora_path).resolve())
        allowed = await asyncio.to_thread(lambda: [Path(root).resolve() for root in roots])
        if not any(resolved.is_relative_to(root) for root in allowed):
            raise invalid(
                "lora_path",
                f"{lora_path} resolves to {resolved}, outside the directories adapters may be loaded "
                f"from (gateway.lora_adapter_roots: {roots}).",
            )
        try:
            await self.llm.run_in_engine(methodcaller("check_lora", str(resolved)))
        except ValueError as e:
            raise invalid("lora_path", str(e).removeprefix("lora_request: ")) from None
        return json.dumps({"path": str(resolved)})

    async def tokenize(self, request: TokenizeRequest) -> str:
        """vLLM's /tokenize with this pool's tokenizer and chat template: the response's JSON; a
        client mistake raises its `OpenAIError` (the gateway unwraps it)."""
        from raylane.deployments.pool.tokenize_offload import tokenize_off_loop

        return await tokenize_off_loop(lambda: self.tokenization.tokenize(request), request)

    async def detokenize(self, request: DetokenizeRequest) -> str:
        """vLLM's /detokenize: off the replica's event loop when long (a million ids took about a
        second of it), at most the pool's context length."""
        from raylane.deployments.pool.tokenize_offload import tokenize_off_loop

        return await tokenize_off_loop(lambda: self.tokenization.detokenize(request), request)

    async def _forward(self, items: AsyncIterator[PoolItem], request: PoolRequest) -> AsyncIterator[PoolItem]:
        self.reporter.start()
        # The replica's span of the request, current while its items are made: the serving code's
        # spans (render, grammar compile) and the engine's go under it (deployments/pool/pool_span.py).
        span = start_pool_span(request, self.pool) if request.trace is not None else None
        token = tracing.attach(span)
        final = None
        try:
            async with aclosing(items):  # leaving early aborts the engine request at once
                async for item in items:
                    final = item
                    yield item
        finally:
            tracing.detach(token)
            end_pool_span(span, final)

    async def _gauges(self) -> tuple[dict, dict]:
        """Engine state for the metrics reporter (the counters stay as they were if the engine died)."""
        from raylane.deployments.metrics.pool import engine_stats

        try:
            self.metrics.set_engine_stats(await self.llm.run_in_engine(engine_stats))
        except Exception:
            return {}, {}
        return self.metrics.gauge_families(), self.metrics.gauge_values(self.reporter.replica)

    async def stats(self) -> dict:
        """Load of this replica (for the router's admission control, /health and tests)."""
        from raylane.deployments.metrics.pool import engine_stats

        self.reporter.start()
        stats = await self.llm.run_in_engine(engine_stats)
        return {"pool": self.pool.name, "model": self.pool.model_id, "pid": os.getpid(), **stats}

    async def startup_times(self) -> dict:
        """When this replica's constructor began, its engine was ready and the constructor ended
        (`time.time()`), with its pid: the phases of a replica's start (`raylane bench recovery`)."""
        return self.startup

    async def record_routing_stats(self) -> dict:
        """Serve calls this every `routing.stats_period_s`; the pool's request router
        (deployments/gateway/request_router.py) reads it as the replica's `routing_stats`."""
        from raylane.deployments.metrics.pool import engine_stats

        stats = await self.llm.run_in_engine(engine_stats)
        return {
            "kv_cache_usage": stats["kv_cache_usage"],
            "num_requests_waiting": stats["num_requests_waiting"],
            # resident adapters by name, for adapter affinity
            "loras": [self.adapter_names[i] for i in stats["lora_ids"] if i in self.adapter_names],
        }

    async def record_autoscaling_stats(self) -> dict:
        """Serve's autoscaler collects this from every replica (deployments/pool/autoscaling.py); its
        metrics must be numbers, so not the routing stats' list of resident adapters."""
        stats = await self.record_routing_stats()
        return {k: v for k, v in stats.items() if k != "loras"}

    async def check_health(self) -> None:
        """Serve calls this periodically; raising marks the replica unhealthy and replaces it."""
        check = getattr(self.llm, "check_health", None)
        if check is not None:
            result = check()
            if inspect.isawaitable(result):
                await result
            return
        # A dead engine thread never answers: the probe times out.
        await asyncio.wait_for(self.llm.run_in_engine(lambda engine: None), HEALTH_PROBE_TIMEOUT_S)

    def __del__(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.shutdown()
        grammar = getattr(self, "grammar", None)
        if grammar is not None:
            grammar.close()


def _replica_name() -> str:
    """This replica's Serve id, or the process id outside Serve (Serve is not imported for it)."""
    serve = sys.modules.get("ray.serve")
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not in a replica
        return str(os.getpid())
