"""A `ModelPool` that remembers the priority and tenant each request reached it with (shipped to
replicas by value).

The gateway passes the tier's priority and the caller's key id with every pool call; the engine
schedules by them. Recording them here, in front of the real pool, lets a test see what a request was
actually served as."""

from raylane.deployments.pool.model_pool import ModelPool
from raylane.deployments.protocol.wire import PoolRequest


class RecordingPool(ModelPool):
    def _record(self, request: PoolRequest) -> None:
        if not hasattr(self, "seen"):
            self.seen: list[tuple[str | None, int, str]] = []
        self.seen.append((request.body.user, request.priority, request.tenant))

    async def chat(self, request: PoolRequest):
        self._record(request)
        async for item in super().chat(request):
            yield item

    async def completions(self, request: PoolRequest):
        self._record(request)
        async for item in super().completions(request):
            yield item

    def priorities(self, user: str) -> list[int]:
        """The priorities of the requests that named `user` (OpenAI's end-user field)."""
        return [priority for u, priority, _ in getattr(self, "seen", []) if u == user]

    def tenants(self, user: str) -> list[str]:
        return [tenant for u, _, tenant in getattr(self, "seen", []) if u == user]
