"""The gateway's relay of a pool stream: the pool's last item ends the response and brings the request's
summary with it; an error event that ends a stream counts against the pool."""

import asyncio

from deployments.errors import unavailable
from deployments.relay import relay
from deployments.wire import FinalItem, RequestSummary, sse_error


class Call:
    """A pool call as the gateway sees it: an async iterator it can cancel."""

    def __init__(self, items):
        self.items, self.cancelled = list(items), False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        return self.items.pop(0)

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
