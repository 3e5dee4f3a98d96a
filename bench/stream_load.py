"""The load `raylane bench scale` puts on a fleet: streamed chat completions over plain aiohttp (the
`openai` client `raylane bench serve` uses parses every chunk into objects: at thousands of streams
on two cores the client would be what is measured), closed-loop (`concurrency` streams at all times)
or open-loop (Poisson arrivals at `rate` a second), for `duration_s`.

Each stream records its TTFT (first content), the time of its last token, its output tokens and the
prompt tokens the server found cached (`usage.prompt_tokens_details.cached_tokens`, the same field
from raylane and from vLLM-shaped servers), or its HTTP status when it failed.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from itertools import cycle
from typing import Any

import aiohttp

from raylane.bench.datasets import BenchRequest


@dataclass(slots=True)
class Stream:
    sent: float
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    status: int = 200
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Target:
    """Where a point's streams go: one base URL, or several that the client takes in turn (`direct`)."""

    name: str
    urls: tuple[str, ...]
    model: str


async def one_stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any], clock) -> Stream:
    stream = Stream(sent=clock())
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            if response.status != 200:
                stream.status, stream.error = response.status, (await response.text())[:200]
                return stream
            async for line in response.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                    now = clock()
                    if stream.ttft is None:
                        stream.ttft = now - stream.sent
                    stream.e2e = now - stream.sent
                if usage := chunk.get("usage"):
                    stream.output_tokens = usage.get("completion_tokens") or 0
                    stream.prompt_tokens = usage.get("prompt_tokens") or 0
                    details = usage.get("prompt_tokens_details") or {}
                    stream.cached_tokens = details.get("cached_tokens") or 0
    except (TimeoutError, aiohttp.ClientError) as e:
        stream.status, stream.error = 0, repr(e)[:200]
    return stream


def request_body(model: str, request: BenchRequest) -> dict[str, Any]:
    return {
        "model": model,
        "messages": request.messages,
        "max_tokens": request.max_tokens,
        "ignore_eos": True,  # every stream runs its full length, on every target alike
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def run_load(
    target: Target,
    requests: list[BenchRequest],
    duration_s: float,
    concurrency: int | None = None,
    rate: float | None = None,
    seed: int = 0,
) -> tuple[list[Stream], float]:
    """Streams sent during `duration_s` (and finished after it), and the seconds the run took."""
    clock = time.monotonic
    bodies = cycle([request_body(target.model, r) for r in requests])
    urls = cycle(target.urls)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    streams: list[Stream] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = clock()
        end = start + duration_s

        async def send() -> None:
            streams.append(await one_stream(session, next(urls), next(bodies), clock))

        if concurrency is not None:

            async def loop() -> None:
                while clock() < end:
                    await send()

            await asyncio.gather(*(loop() for _ in range(concurrency)))
        else:
            rng, tasks, at = random.Random(seed), [], start
            while (at := at + rng.expovariate(rate)) < end:
                await asyncio.sleep(max(0.0, at - clock()))
                tasks.append(asyncio.create_task(send()))
            await asyncio.gather(*tasks)
        return streams, clock() - start
