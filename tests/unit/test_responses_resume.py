"""A pool replica continuing a `/v1/responses` stream that another one began (`ResumeState`), as
tests/unit/test_serving_resume.py does for chat: the events sent before a cut followed by the
continuation's are one Responses stream (sequence numbers 0..N-1, the same response, the same output
items with the same ids and indexes, each text delta once) whose assembled view is the undisturbed
stream's; a forced function call's arguments and a json_schema answer still validate, and reasoning
stays reasoning. Every event is validated as the openai SDK's typed model of its type. Each stream is
cut after some of its items, as the gateway would resume it (deployments/gateway/relay.py adds each relayed
item to the state); the last test has the gateway's relay and Resumer do it, with a stand-in for the
Serve handle whose replica dies."""

import asyncio
import json
import typing

import jsonschema
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from ray.exceptions import ActorDiedError

from raylane.config import ClusterConfig
from raylane.deployments.gateway.pool_health import PoolHealth
from raylane.deployments.gateway.relay import relay
from raylane.deployments.gateway.resumption import Resumer
from raylane.deployments.metrics.pool import MeteredLLM, PoolMetrics
from raylane.deployments.pool.serving_chat import OpenAIServingChat
from raylane.deployments.pool.serving_responses import OpenAIServingResponses
from raylane.deployments.protocol.responses_request import echo, to_chat_request
from raylane.deployments.protocol.responses_schemas import ResponsesRequest
from raylane.deployments.protocol.sampling import chat_params
from raylane.deployments.protocol.wire import FinalItem, PoolRequest, ResumeState, StreamItem
from raylane.engine import AsyncLLM

EVENT_MODELS = {
    member.model_fields["type"].annotation.__args__[0]: member
    for member in typing.get_args(typing.get_args(ResponseStreamEvent)[0])
}
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "name": "get_weather", "parameters": CITY}
COMMON = {"model": "chat", "temperature": 0, "stream": True}
# Thinking forced by a regex; the demo tokenizer has no <think> token, so the tags span tokens
# (and some cuts fall inside one).
THINK_RE = r"<think>\nTwo and two make four\.\n</think>\n\nFour\."


@pytest.fixture(scope="module")
def llm(demo_models):
    # Every step's tokens in an item of their own (no stream batching): the tiny model's whole answer
    # would otherwise fit in one or two items, leaving no place to cut it.
    engine = AsyncLLM(
        model=str(demo_models["raylane-llama-tiny"]), num_kv_blocks=128, stream_batching_interval_ms=0
    )
    yield MeteredLLM(engine, PoolMetrics("chat", "m"))  # as the pool runs it
    engine.shutdown()


class Responses:
    """One Responses request served by a replica's `OpenAIServingResponses`, as the gateway calls
    every replica that serves it: the same chat request, request id and echoed fields."""

    def __init__(self, llm, body: dict, reasoning: str | None = None, ignore_eos: bool = False) -> None:
        req = ResponsesRequest.model_validate(body)
        self.chat_req = to_chat_request(req, []).model_copy(update={"ignore_eos": ignore_eos or None})
        self.params, self.plan = chat_params(self.chat_req)
        self.echo = echo(req, "resp_0123456789abcdef", None)
        self.serving = OpenAIServingResponses(OpenAIServingChat(llm, "chat", 2048), reasoning)

    def create(self, resume: ResumeState | None = None):
        return self.serving.create(self.chat_req, self.params, self.plan, "r1", self.echo, 0, resume)

    def stream(self, resume: ResumeState | None = None) -> list:
        async def items():
            return [item async for item in self.create(resume)]

        return asyncio.run(items())

    def cut_and_resume(
        self, cut: int | None = None, whole: list | None = None
    ) -> tuple[list[str], list[str]]:
        """(the undisturbed stream's SSE texts, the texts sent before a cut after `cut` items (half
        by default) plus the resumed stream's), as the client would receive them. `whole`: the
        undisturbed stream's items, if they were asked for already."""
        whole = self.stream() if whole is None else whole
        assert all(isinstance(i, StreamItem) for i in whole[:-1]) and isinstance(whole[-1], FinalItem)
        cut = len(whole[:-1]) // 2 if cut is None else cut
        assert 1 <= cut < len(whole), whole
        state = ResumeState(created=0)  # a Responses stream's created_at is in `echo`
        for item in whole[:cut]:
            state.add(item)
        resumed = self.stream(state)
        assert all(isinstance(i, StreamItem) for i in resumed[:-1]) and isinstance(resumed[-1], FinalItem)
        return [text(i) for i in whole], [text(i) for i in whole[:cut] + resumed]


def text(item) -> str:
    return item.item if isinstance(item, FinalItem) else item.text


def typed_events(texts: list[str]) -> list:
    """The SSE events of `texts`, each validated as the SDK's model of its type."""
    out = []
    for block in "".join(texts).split("\n\n"):
        if block:
            kind, data = block.split("\n", 1)
            event = EVENT_MODELS[kind.removeprefix("event: ")].model_validate_json(
                data.removeprefix("data: ")
            )
            assert event.type == kind.removeprefix("event: ")
            out.append(event)
    return out


def client_view(texts: list[str]) -> dict:
    """What a client assembles from a Responses stream: the events other than deltas (kind, item id,
    output and content index), the text and arguments per item from the deltas, and the final
    response (its completion time and cache hits aside: the continuation finds the prompt cached)."""
    events = typed_events(texts)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    view = {"frame": [], "deltas": {}, "ids": {events[0].response.id}, "created": set()}
    for e in events:
        if e.type.endswith(".delta"):
            view["deltas"][e.item_id] = view["deltas"].get(e.item_id, "") + e.delta
            continue
        where = (
            getattr(e, "item_id", None),
            getattr(e, "output_index", None),
            getattr(e, "content_index", None),
        )
        item = getattr(e, "item", None)
        ids = (item.id, getattr(item, "call_id", None)) if item is not None else None
        view["frame"].append((e.type, *where, ids))
        if hasattr(e, "response"):
            view["ids"].add(e.response.id)
            view["created"].add(e.response.created_at)
    final = events[-1].response
    Response.model_validate(final.to_dict())
    view["response"] = final.model_dump(mode="json", exclude={"completed_at"})
    view["response"]["usage"]["input_tokens_details"].pop("cached_tokens")
    for item in final.output:  # each delta once: the deltas add up to the whole item
        whole = item.arguments if item.type == "function_call" else item.content[0].text
        assert view["deltas"][item.id] == whole, (item.id, view["deltas"][item.id], whole)
    return view


def test_a_resumed_text_stream_adds_up_to_the_undisturbed_one(llm):
    body = {**COMMON, "input": "tell me a story", "max_output_tokens": 40}
    before, after = map(client_view, Responses(llm, body, ignore_eos=True).cut_and_resume())
    assert after == before
    assert len(before["ids"]) == len(before["created"]) == 1
    assert [kind for kind, *_ in before["frame"]].count("response.created") == 1
    response = before["response"]
    assert response["status"] == "incomplete" and [i["type"] for i in response["output"]] == ["message"]
    assert response["usage"]["output_tokens"] == 40  # each token counted once, across the cut


def test_a_resumed_forced_function_call_keeps_its_item_and_its_arguments_validate(llm):
    body = {**COMMON, "input": "weather?", "tools": [WEATHER], "tool_choice": "required"}
    body |= {"parallel_tool_calls": False, "max_output_tokens": 200}
    before, after = map(client_view, Responses(llm, body).cut_and_resume())
    assert after == before
    [call] = after["response"]["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather" and call["status"] == "completed"
    added = next(f for f in after["frame"] if f[0] == "response.output_item.added")
    assert added[-1] == (call["id"], call["call_id"])  # the call the client saw open completed
    jsonschema.validate(json.loads(call["arguments"]), CITY)


def test_a_resumed_json_schema_answer_validates(llm):
    fmt = {"type": "json_schema", "name": "w", "schema": CITY}
    body = {**COMMON, "input": "json", "text": {"format": fmt}, "max_output_tokens": 200}
    before, after = map(client_view, Responses(llm, body).cut_and_resume())
    assert after == before and after["response"]["status"] == "completed"
    [message] = after["response"]["output"]
    jsonschema.validate(json.loads(message["content"][0]["text"]), CITY)


def test_a_resumed_reasoning_stream_keeps_its_reasoning_item_at_every_cut(llm):
    body = {**COMMON, "input": "What is two and two?", "max_output_tokens": 60}
    request = Responses(llm, body | {"structured_outputs": {"regex": THINK_RE}}, reasoning="qwen3")
    whole = request.stream()
    before = client_view([text(i) for i in whole])
    reasoning, message = before["response"]["output"]
    assert reasoning["content"][0]["text"] == "\nTwo and two make four.\n"
    assert message["content"][0]["text"] == "Four."
    usage = before["response"]["usage"]
    assert 0 < usage["output_tokens_details"]["reasoning_tokens"] < usage["output_tokens"]
    for cut in range(1, len(whole)):  # up to a cut after the last item before the closing one
        _, after = request.cut_and_resume(cut, whole)
        assert client_view(after) == before, cut


class DyingReplica:
    """Stands in for a pool's Serve handle (Serve does not run in unit tests): each call is served by
    the real serving layer above; the first call's replica dies after `dies_after` items, and the
    call raises what Serve raises for a dead replica actor."""

    def __init__(self, request: Responses, dies_after: int) -> None:
        self.request, self.dies_after, self.calls = request, dies_after, 0

    def options(self, stream: bool) -> "DyingReplica":
        return self

    @property
    def responses(self) -> "DyingReplica":  # handle.responses.remote(pool_request)
        return self

    def remote(self, request: PoolRequest) -> "Call":
        self.calls += 1
        return Call(self.request.create(request.resume), self.dies_after if self.calls == 1 else None)


class Call:
    def __init__(self, items, dies_after: int | None) -> None:
        self.items, self.left = items, dies_after

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.left == 0:
            await self.items.aclose()  # the replica's engine request ends with it
            raise ActorDiedError()
        if self.left is not None:
            self.left -= 1
        return await anext(self.items)

    def cancel(self) -> None:
        pass  # the stand-in stream is closed when it dies or drained when it ends


def test_a_responses_stream_whose_replica_dies_goes_on_through_the_gateways_relay(llm):
    """The gateway's side (relay, Resumer): what it passes on to the client from a replica that died
    halfway, then from the one that resumed, is the undisturbed stream."""
    body = {**COMMON, "input": "weather?", "tools": [WEATHER], "tool_choice": "required"}
    request = Responses(llm, body | {"parallel_tool_calls": False, "max_output_tokens": 200})
    whole = [text(i) for i in request.stream()]
    replica = DyingReplica(request, dies_after=len(whole) // 2)
    config = ClusterConfig.from_dict({"pools": [{"name": "chat", "model": "raylane-llama-tiny"}]})

    async def client() -> tuple[list[str], int]:
        # Only the request's endpoint, id and resume state reach the stand-in replica.
        pool_request = PoolRequest("responses", None, None, "r1")
        health = PoolHealth({"chat": replica}, None, 1.0)
        resumer = Resumer(config, {"chat": replica}, health, pool_request, ["chat"])
        call = pool_request.call(replica)
        sent = [t async for t in relay(await anext(call), call, None, None, resumer, "chat")]
        return sent, resumer.count

    sent, resumptions = asyncio.run(client())
    assert resumptions == 1 and replica.calls == 2
    assert client_view(sent) == client_view(whole)
