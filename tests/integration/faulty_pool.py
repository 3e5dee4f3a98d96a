"""A `ModelPool` whose failures a test switches on and off (shipped to replicas by value)."""

import asyncio

from raylane.deployments.pool.model_pool import ModelPool
from raylane.deployments.protocol.errors import invalid


class FaultyPool(ModelPool):
    """fault None: a normal pool; "hold": requests wait (holding their gateway slot) until the fault
    is cleared; "error": requests fail before their first item; "down": stats fail too, as a pool
    without a live replica looks to the gateway; "linger": after its last item a request's stream
    stays open until the fault is cleared; "client_error": requests are refused by raising (not
    yielding) a 400 before their first item; "poison": requests whose body holds the word POISON
    raise an internal error (a bug some content triggers), the others are served; "busy": requests
    are served, but stats wait until the fault is cleared, as a replica whose every slot is taken by
    long streams answers the gateway's probe only when one ends."""

    fault: str | None = None

    def set_fault(self, fault: str | None) -> None:
        self.fault = fault

    async def _gate(self, request=None) -> None:
        if self.fault == "client_error":
            raise invalid("messages", "injected fault: the pool refuses these messages")
        if self.fault == "poison" and request is not None and "POISON" in request.body.model_dump_json():
            raise KeyError("injected fault: this content crashes the pool")
        while self.fault == "hold":
            await asyncio.sleep(0.05)
        if self.fault in ("error", "down"):
            raise RuntimeError(f"injected fault: {self.fault}")

    async def _linger(self) -> None:
        while self.fault == "linger":
            await asyncio.sleep(0.05)

    async def chat(self, *args, **kwargs):
        await self._gate(args[0])
        async for item in super().chat(*args, **kwargs):
            yield item
        await self._linger()

    async def completions(self, *args, **kwargs):
        await self._gate(args[0])
        async for item in super().completions(*args, **kwargs):
            yield item
        await self._linger()

    async def stats(self) -> dict:
        if self.fault == "down":
            raise RuntimeError("injected fault: down")
        while self.fault == "busy":
            await asyncio.sleep(0.05)
        return await super().stats()
