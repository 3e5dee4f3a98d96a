"""The gateway's relay of a pool stream: the pool's last item ends the response and brings the request's
summary with it; an error event that ends a stream counts against the pool."""

import asyncio

from raylane.deployments.gateway.relay import relay
from raylane.deployments.protocol.errors import unavailable
from raylane.deployments.protocol.wire import FinalItem, RequestSummary, StreamItem, sse_error


class Call:
    """A pool call as the gateway sees it: an async iterator it can cancel."""

    def __init__(self, items):
        self.items, self.cancelled = list(items), False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, Exception):  # the call fails here
            raise item
        return item

    def cancel(self):
        self.cancelled = True


class Slot:
    outcome = None

    def failed(self, reason=None):
        self.outcome = "failed"

    def succeeded(self):
        self.outcome = "succeeded"


async def relayed(first, call, slot):
    usage = []
    sent = [chunk async for chunk in relay(first, call, slot, usage.append)]
    await asyncio.sleep(0)  # the end of the pool's stream is read in the background
    return sent, usage


def test_the_last_item_ends_the_response_with_the_requests_tokens():
    summary = RequestSummary(prompt_tokens=3, completion_tokens=5, finish_reasons=["stop"])
    call, slot = Call(["b", FinalItem("c[DONE]", summary), "the end of the pool's stream"]), Slot()
    sent, usage = asyncio.run(relayed("a", call, slot))
    assert sent == ["a", "b", "c[DONE]"]
    assert usage == [8]  # from the summary, not the three events
    assert slot.outcome == "succeeded" and call.items == [] and not call.cancelled


def test_a_stream_the_engine_failure_ended_counts_against_the_pool():
    error = sse_error(unavailable("The model pool's engine failed"))
    summary = RequestSummary(prompt_tokens=3, completion_tokens=1, finish_reasons=["error"])
    call, slot = Call([FinalItem(error, summary)]), Slot()
    sent, usage = asyncio.run(relayed("a", call, slot))
    assert sent == ["a", error] and usage == [4] and slot.outcome == "failed"


def test_a_stream_that_is_one_item_is_relayed_whole():
    call, slot = Call([]), Slot()
    sent, usage = asyncio.run(relayed(FinalItem("all[DONE]"), call, slot))
    assert sent == ["all[DONE]"] and usage == [1] and slot.outcome == "succeeded"


class Resumer:
    """Stands in for raylane.deployments.gateway.resumption.Resumer: tracks the items relayed and continues on
    `then`."""

    def __init__(self, then: Call | None):
        self.then, self.tokens, self.tokens_before, self.failures = then, 0, 0, []

    @property
    def state(self):
        return self.tokens or None

    def track(self, item: StreamItem) -> None:
        self.tokens += sum(len(ids) for ids in item.token_ids.values())

    async def resume(self, pool, failure):
        self.failures.append(failure)
        self.tokens_before = self.tokens
        return None if self.then is None else (await self.then.__anext__(), self.then)


def test_a_stream_whose_replica_died_goes_on_from_its_resumption():
    died = RuntimeError("replica died")
    call = Call([StreamItem("b", {0: [2]}), died, "never read"])
    summary = RequestSummary(prompt_tokens=3, completion_tokens=1, finish_reasons=["length"])
    resumer, slot = Resumer(Call([StreamItem("c", {0: [3]}), FinalItem("d[DONE]", summary)])), Slot()
    slot.pool = "p"
    usage = []
    sent = asyncio.run(_collect(relay(StreamItem("a", {0: [1]}), call, slot, usage.append, resumer)))
    assert sent == ["a", "b", "c", "d[DONE]"] and resumer.failures == [died] and call.cancelled
    assert usage == [3 + 1 + 2] and slot.outcome == "succeeded"  # the tokens sent before count too


def test_a_stream_that_cannot_be_resumed_ends_with_the_error_event():
    call, slot = Call([RuntimeError("replica died")]), Slot()
    slot.pool = "p"
    sent = asyncio.run(_collect(relay(StreamItem("a", {0: [1]}), call, slot, None, Resumer(None))))
    assert sent[0] == "a" and sent[1].startswith('data: {"error"') and slot.outcome == "failed"


async def _collect(stream):
    return [chunk async for chunk in stream]


def test_a_client_that_stops_reading_loses_its_slot_after_the_write_bound():
    """The client reads the response's start and first event, then nothing: the next write blocks (a
    server with backpressure, its socket buffers full). Past the bound the stream is closed: the pool
    call is cancelled and the slot released, while the pool still had events to send."""
    from raylane.deployments.gateway.relay import BoundedStreamingResponse

    call, slot = Call([f"event {i}" for i in range(1000)]), Slot()
    usage: list[int] = []
    sent: list[dict] = []
    never = asyncio.Event()

    async def send(message: dict) -> None:
        if len(sent) >= 2:
            await never.wait()  # the client's buffers are full and it does not read
        sent.append(message)

    async def main() -> None:
        response = BoundedStreamingResponse(relay("first", call, slot, usage.append), write_timeout_s=0.05)
        scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
        # A guard against hanging, not a timing check: unbounded, the write waits forever.
        await asyncio.wait_for(response(scope, None, send), 60)

    asyncio.run(main())
    assert [m.get("body") for m in sent] == [None, b"first"]
    assert call.cancelled and slot.outcome == "succeeded" and usage == [2]
    assert len(call.items) > 900  # cut off, not run to the end
