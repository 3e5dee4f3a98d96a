"""`/v1/responses` driven by the unmodified `openai` SDK (`client.responses.*`) against the session's
app: served by the same pools as chat (same greedy text, same token counts), streamed events in
OpenAI's order and valid as the SDK's own typed event models, function tools, JSON schemas, and
conversations continued by `previous_response_id` from the Ray-actor store."""

import json
import typing

import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from tests.integration.test_openai_api import PARAMS_BY_NAME, WEATHER_PARAMS, prompt_tokens

# Each event type's SDK model (the union's members), so a mismatch names that model's fields.
EVENT_MODELS = {
    member.model_fields["type"].annotation.__args__[0]: member
    for member in typing.get_args(typing.get_args(ResponseStreamEvent)[0])
}
QUESTION = "Write one sentence about the sea."
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Forecast for a city.",
    "parameters": WEATHER_PARAMS,
}
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]}, "rain": {"type": "boolean"}},
    "required": ["city", "rain"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer():
    from raylane.models.demo import load_tokenizer

    return load_tokenizer()


def typed_events(stream) -> list:
    """The stream's events, each validated (not just constructed) as the SDK's model of its type."""
    events = [EVENT_MODELS[event.type].model_validate(event.to_dict()) for event in stream]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def kinds(events) -> list[str]:
    return [e.type for e in events]


def test_plain_response_is_the_chat_answer(client):
    r = client.responses.create(
        model="chat", input=QUESTION, instructions="Answer briefly.", max_output_tokens=12, temperature=0
    )
    chat = client.chat.completions.create(
        model="chat",
        messages=[{"role": "developer", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}],
        max_tokens=12,
        temperature=0,
    )
    Response.model_validate(r.to_dict())  # validated as the SDK's model, not just constructed
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "raylane-llama-tiny"
    assert [item.type for item in r.output] == ["message"]
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "Answer briefly." and r.max_output_tokens == 12
    if chat.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None


def test_streamed_events_in_openai_order(client):
    whole = client.responses.create(model="chat", input=QUESTION, max_output_tokens=16, temperature=0)
    events = typed_events(
        client.responses.create(
            model="chat", input=QUESTION, max_output_tokens=16, temperature=0, stream=True
        )
    )
    k = kinds(events)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert k[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert k[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas) and deltas
    assert k[4 + len(deltas) :] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if whole.status == "completed" else "response.incomplete",
    ]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in deltas)
    text = "".join(e.delta for e in deltas)
    final = events[-1].response
    assert text == events[4 + len(deltas)].text == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.id == events[0].response.id


def test_function_tool_call(client):
    r = client.responses.create(
        model="chat",
        input="Weather in Paris for 3 days?",
        tools=[WEATHER_TOOL],
        tool_choice="required",
        max_output_tokens=64,
        temperature=0,
    )
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" and c.call_id.startswith("call_") for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), PARAMS_BY_NAME["get_weather"])


def test_function_tool_call_streamed(client):
    events = typed_events(
        client.responses.create(
            model="chat",
            input="Weather in Lima?",
            tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=64,
            temperature=0,
            stream=True,
        )
    )
    added = [e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    assert len(added) == 1 and added[0].item.name == "get_weather"
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert deltas and "".join(e.delta for e in deltas) == done.arguments
    jsonschema.validate(json.loads(done.arguments), WEATHER_PARAMS)
    assert kinds(events)[-2:] == ["response.output_item.done", "response.completed"]
    assert events[-1].response.output[-1].arguments == done.arguments


def test_json_schema_text_format(client):
    r = client.responses.create(
        model="chat",
        input="Is it raining in Paris? Answer in JSON.",
        text={"format": {"type": "json_schema", "name": "rain", "schema": CITY_SCHEMA, "strict": True}},
        max_output_tokens=40,
        temperature=0,
    )
    jsonschema.validate(json.loads(r.output_text), CITY_SCHEMA)
    assert r.text.format.type == "json_schema"


def test_previous_response_id_continues_the_conversation(client, tokenizer):
    first = client.responses.create(model="chat", input="My name is Ada.", max_output_tokens=8, temperature=0)
    second = client.responses.create(
        model="chat", previous_response_id=first.id, input="What is my name?", max_output_tokens=8
    )
    conversation = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == prompt_tokens(tokenizer, conversation)
    assert client.responses.retrieve(first.id).output_text == first.output_text


def test_a_streamed_response_is_stored_when_it_completes(client, tokenizer):
    events = typed_events(
        client.responses.create(model="chat", input="My name is Bo.", max_output_tokens=6, stream=True)
    )
    streamed = events[-1].response
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text
    follow = client.responses.create(
        model="chat", previous_response_id=streamed.id, input="Who am I?", max_output_tokens=4
    )
    conversation = [
        {"role": "user", "content": "My name is Bo."},
        {"role": "assistant", "content": streamed.output_text},
        {"role": "user", "content": "Who am I?"},
    ]
    assert follow.usage.input_tokens == prompt_tokens(tokenizer, conversation)


def test_function_call_output_continues_a_tool_call(client, tokenizer):
    first = client.responses.create(
        model="chat",
        input="Weather in Paris for 2 days?",
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=64,
        temperature=0,
    )
    call = first.output[-1]
    assert call.type == "function_call"
    follow = client.responses.create(
        model="chat",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C."}],
        tools=[WEATHER_TOOL],
        max_output_tokens=8,
    )
    conversation = [
        {"role": "user", "content": "Weather in Paris for 2 days?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": call.arguments}}],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C."},
    ]
    tools = [{"type": "function", "function": {k: v for k, v in WEATHER_TOOL.items() if k != "type"}}]
    assert follow.usage.input_tokens == prompt_tokens(tokenizer, conversation, tools)


def test_get_and_delete_stored_responses(client):
    r = client.responses.create(model="chat", input="Hello", max_output_tokens=4)
    assert client.responses.retrieve(r.id).id == r.id
    deleted = client.responses.delete(r.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="chat", previous_response_id=r.id, input="Go on.", max_output_tokens=4)
    assert e.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model="chat", input="Hello", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_unsupported_and_unknown_fields_are_named(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="chat", input="Hi", background=True)
    assert e.value.body["param"] == "background" and e.value.body["code"] == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="chat", input="Hi", extra_body={"frobnicate": 1})
    assert e.value.body["param"] == "frobnicate"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model="chat",
            input="Hi",
            text={"format": {"type": "json_schema", "name": "x", "schema": {"type": 3}}},
        )
    assert e.value.body["param"].startswith("text.format")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model="chat", input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]
        )
    assert e.value.body["param"].startswith("input[0]")


def test_with_api_keys_a_stored_response_is_its_own_keys(router_server):
    """On the keyed router app: another key cannot read, continue or delete a response."""
    from tests.live_servers import ROUTER_KEYS

    def keyed(tier: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=router_server.base_url, api_key=ROUTER_KEYS[tier], max_retries=0, timeout=120
        )

    owner, other = keyed("premium"), keyed("standard")
    r = owner.responses.create(model="coding", input="Hello", max_output_tokens=2)
    for attempt in (
        lambda: other.responses.retrieve(r.id),
        lambda: other.responses.delete(r.id),
        lambda: other.responses.create(
            model="coding", previous_response_id=r.id, input="Hi", max_output_tokens=2
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert owner.responses.retrieve(r.id).id == r.id
