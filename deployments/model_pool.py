"""A model pool replica: one `AsyncLLM` serving OpenAI chat and completions to the gateway.

`deployments.app` wraps this class with `serve.deployment` and the pool's options: a placement
group with one bundle per rank, so at tensor-parallel size > 1 the engine's Ray executor starts its
rank actors inside the replica's own bundles (as Ray Serve LLM does); at size 1 the engine runs in
this process. The class itself does not import Serve, so it runs (and is tested) without it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator

from cluster.config import PoolConfig
from deployments.errors import OpenAIError
from deployments.openai_schemas import ChatCompletionRequest, CompletionRequest
from deployments.sampling import ToolPlan
from deployments.serving import OpenAIServing
from engine import AsyncLLM, SamplingParams

logger = logging.getLogger(__name__)
HEALTH_PROBE_TIMEOUT_S = 10.0


class ModelPool:
    def __init__(self, pool: PoolConfig | dict):
        self.pool = PoolConfig.model_validate(pool)
        if self.pool.demo_model is not None:  # a fresh node: write the demo checkpoint it serves
            from cluster.demo_models import create_demo_models, default_demo_dir

            create_demo_models(default_demo_dir(), names=[self.pool.demo_model])
        config = self.pool.engine_config()
        logger.info("pool %s: loading %s", self.pool.name, config.model)
        self.llm = AsyncLLM(config)
        max_model_len = getattr(self.llm.engine, "max_model_len", None) or config.max_model_len
        self.serving = OpenAIServing(self.llm, self.pool.model_id, max_model_len)

    async def chat(
        self, request: ChatCompletionRequest, params: SamplingParams, plan: ToolPlan, request_id: str
    ) -> AsyncIterator[str | OpenAIError]:
        async for item in self.serving.chat(request, params, plan, request_id):
            yield item

    async def completions(
        self, request: CompletionRequest, params: SamplingParams, request_id: str
    ) -> AsyncIterator[str | OpenAIError]:
        async for item in self.serving.completion(request, params, request_id):
            yield item

    async def stats(self) -> dict:
        """Load of this replica (for the router's admission control, /health and tests)."""

        def read(engine) -> dict:
            blocks, scheduler = engine.block_manager, engine.scheduler
            return {
                "num_requests_running": len(scheduler.running),
                "num_requests_waiting": len(scheduler.waiting),
                "kv_cache_usage": blocks.usage,
                "num_kv_blocks": blocks.num_blocks,
                "num_free_kv_blocks": blocks.num_free_blocks,
                "num_preemptions": scheduler.num_preemptions,
            }

        stats = await self.llm.run_in_engine(read)
        return {"pool": self.pool.name, "model": self.pool.model_id, **stats}

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
