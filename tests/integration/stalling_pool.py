"""A `ModelPool` that holds a stream whose last message says HOLD after its first items, until its
replica is killed: a test then knows which replica a stream is on when it kills it (shipped to the
replicas by value). A continuation (a resumed stream) is never held."""

import asyncio

from raylane.deployments.pool.model_pool import ModelPool

HOLD = "HOLD"
HELD_AFTER_ITEMS = 2


class StallingPool(ModelPool):
    async def chat(self, request):
        held = request.resume is None and HOLD in str(request.body.messages[-1].content)
        sent = 0
        async for item in super().chat(request):
            yield item
            sent += 1
            if held and sent == HELD_AFTER_ITEMS:
                await asyncio.Event().wait()  # until this replica is killed
