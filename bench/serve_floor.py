"""Serve's floor: what Ray Serve alone costs for raylane's request path, with no raylane code in it.

`raylane bench overhead` compares the HTTP path (proxy or HAProxy -> gateway -> pool -> engine) with
the engine in-process. Part of that difference is Serve's: the proxy hop, the ingress replica, the
deployment-handle call to a second replica and each streamed chunk coming back the same way. This
module deploys that topology bare, as its own Serve app beside raylane's:

- `FloorGateway`, a FastAPI ingress that parses the JSON body and relays a `stream=True` handle call
  to the pool as a `StreamingResponse`, as any two-deployment OpenAI server on Serve must;
- `FloorPool`, which runs no model: it replays a timeline recorded from the in-process engine for
  the same request (`replay`: [seconds, text] per engine output, timed from when the in-process
  request was sent, prompt rendering included, and replayed from when the call arrives), formatting
  each output as a chat-completion chunk and folding finish, usage and `[DONE]` into the last, as the
  pool does. Outputs whose time has passed when the stream falls behind go as one item, as the
  engine merges outputs for a consumer that lags.

So floor - in-process is what Serve's path costs on this machine, and raylane - floor what raylane's
own code adds on top (auth, validation, routing, the pool's chunk formatting and metrics), together
with the engine's steps slowed by the serving processes beside it: the stand-in's take no CPU.
"""

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

REPLICA_CPUS = 0.1  # logical: both replicas idle between requests, like raylane's gateway


def chunk_event(model: str, created: int, delta: dict[str, Any], finish: str | None = None) -> str:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    body = {"id": "floor", "object": "chat.completion.chunk", "created": created, "model": model}
    return f"data: {json.dumps(body | {'choices': [choice]})}\n\n"


def replay_events(model: str, texts: list[str], usage: dict[str, int]) -> list[str]:
    """One SSE item per engine output: the role in the first, finish, usage and [DONE] in the last."""
    created = int(time.time())
    events = []
    for i, text in enumerate(texts):
        delta = {"role": "assistant", "content": text} if i == 0 else {"content": text}
        event = chunk_event(model, created, delta)
        if i == len(texts) - 1:
            usage_body = {"id": "floor", "object": "chat.completion.chunk", "created": created}
            event += chunk_event(model, created, {}, "length")
            event += f"data: {json.dumps(usage_body | {'model': model, 'choices': [], 'usage': usage})}\n\n"
            event += "data: [DONE]\n\n"
        events.append(event)
    return events


@serve.deployment(ray_actor_options={"num_cpus": REPLICA_CPUS})
class FloorPool:
    # Per instance, so that a test can fake the clock of one pool without touching the process's.
    clock = staticmethod(time.perf_counter)
    sleep = staticmethod(asyncio.sleep)

    async def replay(self, body: dict[str, Any]) -> AsyncIterator[str]:
        arrived = self.clock()
        timeline = body["replay"]
        usage = {"prompt_tokens": 0, "completion_tokens": body.get("replay_tokens", len(timeline))}
        usage["total_tokens"] = usage["completion_tokens"]
        events = replay_events(body["model"], [text for _, text in timeline], usage)
        i = 0
        while i < len(events):
            delay = arrived + timeline[i][0] - self.clock()
            if delay > 0:
                await self.sleep(delay)
            due = i + 1  # everything whose time has come goes in one item
            while due < len(events) and arrived + timeline[due][0] <= self.clock():
                due += 1
            yield "".join(events[i:due])
            i = due


floor_api = FastAPI()


@serve.deployment(ray_actor_options={"num_cpus": REPLICA_CPUS})
@serve.ingress(floor_api)
class FloorGateway:
    def __init__(self, pool):
        # The same transport as raylane's gateway to its pools: gRPC when Serve runs with it.
        grpc = os.environ.get("RAY_SERVE_USE_GRPC_BY_DEFAULT") == "1"
        self.pool = pool.options(method_name="replay", stream=True, _by_reference=not grpc)

    @floor_api.get("/health")
    async def health(self) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @floor_api.post("/v1/chat/completions")
    async def chat(self, request: Request) -> StreamingResponse:
        body = await request.json()
        return StreamingResponse(self.pool.remote(body), media_type="text/event-stream")


def floor_app() -> serve.Application:
    return FloorGateway.bind(FloorPool.bind())
