"""Reading a request body (deployments/gateway/request_body.py) as the gateway does, on a real Starlette
`Request`: the wrong element named in a huge body, and large bodies parsed off the event loop."""

import json
import threading

import pytest
from starlette.requests import Request

import raylane.deployments.gateway.request_body as request_body
from raylane.deployments.gateway.request_body import INLINE_BODY_BYTES, parse_body, unencodable_text
from raylane.deployments.protocol.errors import OpenAIError
from raylane.deployments.protocol.openai_schemas import ChatCompletionRequest

LIMIT = 8 * 1024 * 1024


def request_of(body: bytes) -> Request:
    chunks = [body[i : i + 65536] for i in range(0, len(body), 65536)] or [b""]

    async def receive():
        chunk = chunks.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers}, receive)


def test_the_first_wrong_element_of_a_huge_array_is_named():
    data = {"model": "chat", "messages": [{"role": "user", "content": "fine"} for _ in range(200_000)]}
    data["messages"][123_456]["content"] = "bad \ud800 text"
    data["messages"][150_000]["content"] = [{"type": "text", "text": "also \udfff bad"}]
    assert unencodable_text(data) == "messages[123456].content"
    data["messages"][123_456]["content"] = "fixed"
    assert unencodable_text(data) == "messages[150000].content[0].text"
    data["messages"][150_000]["content"] = "fixed"
    assert unencodable_text(data) is None


def test_a_wrong_key_names_the_object_holding_it_and_scalars_are_checked():
    assert unencodable_text({"metadata": {"ok": "1", "k\ud800": "v"}}) == "metadata"
    assert unencodable_text({"k\ud800": 1}) == "k\\ud800"
    assert unencodable_text("\udfff") == "" and unencodable_text(7) is None and unencodable_text([]) is None
    assert unencodable_text({"a": [[], {}, [["x", "\ud800"]]]}) == "a[2][0][1]"


async def test_a_large_body_is_parsed_off_the_event_loop_and_a_small_one_inline(monkeypatch):
    threads: list[bool] = []
    walk = request_body.unencodable_text

    def recording_walk(value):
        threads.append(threading.current_thread() is threading.main_thread())
        return walk(value)

    monkeypatch.setattr(request_body, "unencodable_text", recording_walk)
    small = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
    large = {"model": "chat", "messages": [{"role": "user", "content": "x" * 1000}] * 300}
    assert len(json.dumps(large)) > INLINE_BODY_BYTES > len(json.dumps(small))
    for body in (small, large):
        req = await parse_body(request_of(json.dumps(body).encode()), ChatCompletionRequest, LIMIT)
        assert len(req.messages) == len(body["messages"])
    assert threads == [True, False]  # the loop's thread walked the small body, another the large one


async def test_errors_from_the_thread_are_the_same_4xx():
    bad = {"model": "chat", "messages": [{"role": "user", "content": "x" * 100_000}], "temprature": 1}
    with pytest.raises(OpenAIError) as excinfo:
        await parse_body(request_of(json.dumps(bad).encode()), ChatCompletionRequest, LIMIT)
    assert excinfo.value.status == 400 and excinfo.value.param == "temprature"
    body = b'{"model": "chat", "messages": [{"role": "user", "content": "\\ud800' + b"x" * 100_000 + b'"}]}'
    with pytest.raises(OpenAIError) as excinfo:
        await parse_body(request_of(body), ChatCompletionRequest, LIMIT)
    assert excinfo.value.param == "messages[0].content"
