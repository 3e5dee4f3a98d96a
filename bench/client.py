"""The load generator: streaming chat completions through the official `openai` client, timed per chunk.

Requests go out under a concurrency limit (a semaphore) or at Poisson arrival times for a request
rate. Each stream asks for `stream_options={"include_usage": True}` so token counts come from the
server's final usage chunk, exact; a server that sends none gets its content chunks counted instead
(the record says which). Failures become records with an error code: the HTTP status of an
`openai.APIStatusError`, or "timeout", "connection", "stream_error" (an error event after the stream
began), "no_output" (a stream without generated text). The client never retries: a retried 429
would hide exactly the shedding a benchmark should show.
"""

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from raylane.bench.datasets import BenchRequest
from raylane.bench.metrics import RequestRecord

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class Endpoint:
    base_url: str
    model: str
    api_key: str = "EMPTY"
    label: str = ""


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """What every request sends besides its messages and max_tokens."""

    temperature: float = 0.0
    # vLLM's extension, which raylane's gateway accepts: outputs run to max_tokens, so every endpoint
    # and every sweep point generates the same number of tokens. Off for servers that reject it.
    ignore_eos: bool = True
    timeout_s: float = 600.0
    extra_body: dict[str, Any] = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        return {"ignore_eos": True, **self.extra_body} if self.ignore_eos else dict(self.extra_body)


def make_client(endpoint: Endpoint, options: RequestOptions):
    import openai

    return openai.AsyncOpenAI(
        base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0, timeout=options.timeout_s
    )


def has_text(delta: Any) -> bool:
    """Whether a chunk's delta carries generated output (text, reasoning text or a tool call)."""
    if delta is None:
        return False
    return bool(delta.content or getattr(delta, "reasoning_content", None) or delta.tool_calls)


async def measure_stream(stream: AsyncIterable[Any], sent_at: float, clock: Clock) -> RequestRecord:
    """Time one stream of chat completion chunks: TTFT, the gaps between content chunks, E2E."""
    record = RequestRecord()
    last_text_at: float | None = None
    text_chunks = 0
    async for chunk in stream:
        now = clock()
        if chunk.usage is not None:
            record.output_tokens = chunk.usage.completion_tokens
            record.prompt_tokens = chunk.usage.prompt_tokens
            record.usage_reported = True
        if any(has_text(choice.delta) for choice in chunk.choices):
            if last_text_at is None:
                record.ttft = now - sent_at
            else:
                record.itl.append(now - last_text_at)
            last_text_at = now
            text_chunks += 1
    record.e2e = clock() - sent_at
    if not record.usage_reported:
        record.output_tokens = text_chunks
    if record.ttft is None:
        record.error_code, record.error = "no_output", "the stream carried no generated text"
    return record


def chat_stream_args(model: str, request: BenchRequest, options: RequestOptions) -> dict[str, Any]:
    """Arguments of `client.chat.completions.create` for one benchmark request: streamed, with usage."""
    return {
        "model": model,
        "messages": request.messages,
        "max_tokens": request.max_tokens,
        "temperature": options.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": options.body() or None,
    }


async def send_one(
    client, model: str, request: BenchRequest, options: RequestOptions, clock: Clock = time.perf_counter
) -> RequestRecord:
    import openai

    sent_at = clock()
    try:
        stream = await client.chat.completions.create(**chat_stream_args(model, request, options))
        record = await measure_stream(stream, sent_at, clock)
    except openai.APIStatusError as e:
        record = RequestRecord(error_code=str(e.status_code), error=e.message)
    except openai.APITimeoutError as e:
        record = RequestRecord(error_code="timeout", error=str(e))
    except openai.APIConnectionError as e:
        record = RequestRecord(error_code="connection", error=f"{e}: {e.__cause__ or ''}")
    except openai.APIError as e:
        record = RequestRecord(error_code="stream_error", error=e.message)
    if not record.ok:
        record.ttft, record.e2e, record.itl = None, None, []
    if not record.usage_reported:
        record.prompt_tokens = request.prompt_tokens
    return record


def poisson_arrivals(num: int, rate: float, seed: int) -> list[float]:
    """Send times (seconds from the start) of a Poisson process at `rate` requests/s; inf = all at 0."""
    if rate == float("inf"):
        return [0.0] * num
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(num):
        times.append(t)
        t += rng.expovariate(rate)
    return times


async def run_requests(
    client,
    model: str,
    requests: Sequence[BenchRequest],
    options: RequestOptions,
    *,
    concurrency: int | None = None,
    request_rate: float | None = None,
    seed: int = 0,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send every request, at most `concurrency` at once or at Poisson times for `request_rate`.

    Returns the records in request order and the wall time from the first send to the last finish.
    """
    clock = time.perf_counter
    limit = asyncio.Semaphore(concurrency) if concurrency else None
    arrivals = poisson_arrivals(len(requests), request_rate, seed) if request_rate else [0.0] * len(requests)
    start = clock()

    async def one(request: BenchRequest, arrival: float) -> RequestRecord:
        delay = start + arrival - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        async with limit or contextlib.nullcontext():
            sent = clock()
            record = await send_one(client, model, request, options, clock)
        record.start = sent - start
        if on_done is not None:
            on_done(record)
        return record

    records = await asyncio.gather(*(one(r, t) for r, t in zip(requests, arrivals, strict=True)))
    return list(records), clock() - start
