"""The request log: one JSON line per finished request with the fields an operator greps for, never the
prompt or the API key; the request id honoured and echoed once; fallbacks and sheds read right."""

import asyncio
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from raylane.deployments.gateway.request_log import RequestLogMiddleware
from raylane.deployments.gateway.request_record import RequestRecord, note_summary, router_timed
from raylane.deployments.protocol.wire import RequestSummary

SECRET = "my-secret-prompt-words"
API_KEY = "sk-very-secret-key"


def make_app(records: list[RequestRecord]) -> FastAPI:
    app = FastAPI()
    app.add_middleware(RequestLogMiddleware, on_complete=records.append)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        await router_timed(asyncio.sleep(0))
        body = await request.json()
        if body.get("busy"):
            headers = {"x-raylane-tier": "free", "x-raylane-route": "chat"}
            return JSONResponse({"error": {"code": "overloaded"}}, status_code=429, headers=headers)

        async def stream():
            yield "data: {}\n\n"
            note_summary(RequestSummary(5, 3, 0, 0.01, ["length"]))
            yield "data: [DONE]\n\n"

        headers = {
            "x-raylane-route": "coding",
            "x-raylane-pool": "chat",
            "x-raylane-tier": "premium",
            "x-raylane-fallback": "coding;reason=error, reasoning;reason=saturated",
            "x-request-id": "the-engine-id",  # the handler's own: dropped in favour of the client's
        }
        return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)

    @app.get("/health")
    async def health():
        return {"ok": True}

    return app


def call(app, path: str, body: dict, headers: dict[str, str]) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    scope = {
        "type": "http",
        "method": "POST" if body else "GET",
        "path": path,
        "root_path": "",
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
        "http_version": "1.1",
        "scheme": "http",
        "server": ("test", 80),
        "client": ("127.0.0.1", 1),
    }
    data = json.dumps(body).encode() if body else b""
    messages = [{"type": "http.request", "body": data, "more_body": False}]
    sent: list[dict] = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body_bytes = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], start["headers"], body_bytes


def chat_body() -> dict:
    return {"model": "chat", "messages": [{"role": "user", "content": SECRET}]}


def test_a_streamed_request_logs_one_line_with_its_fields_and_no_prompt_or_key():
    records: list[RequestRecord] = []
    auth = {"authorization": f"Bearer {API_KEY}", "x-request-id": "client-id-1"}
    status, headers, _ = call(make_app(records), "/v1/chat/completions", chat_body(), auth)
    assert status == 200
    assert [v for k, v in headers if k == b"x-request-id"] == []  # Serve's proxy echoes the client's id
    [record] = records
    line = record.to_json()
    assert SECRET not in line and API_KEY not in line and "\n" not in line
    entry = json.loads(line)
    assert entry["request_id"] == "client-id-1" and entry["endpoint"] == "/v1/chat/completions"
    assert (entry["status"], entry["route"], entry["pool"], entry["tier"]) == (
        200,
        "coding",
        "chat",
        "premium",
    )
    assert entry["fallback"] == "coding;reason=error, reasoning;reason=saturated"
    assert (entry["prompt_tokens"], entry["completion_tokens"], entry["finish_reason"]) == (5, 3, "length")
    assert entry["ttft_s"] == 0.01 and entry["latency_s"] >= 0
    assert record.router_latency_s is not None
    # Each pool left went to the next one left, the last to the pool that served.
    assert record.fallbacks() == [("coding", "reasoning", "error"), ("reasoning", "chat", "saturated")]


def test_a_request_without_an_id_gets_one_and_it_is_returned():
    records: list[RequestRecord] = []
    _, headers, _ = call(make_app(records), "/v1/chat/completions", chat_body(), {})
    [echoed] = [v.decode() for k, v in headers if k == b"x-request-id"]
    assert echoed == records[0].request_id and len(echoed) >= 16


def test_prompts_are_logged_only_when_the_debug_setting_asks(monkeypatch):
    monkeypatch.setenv("RAYLANE_LOG_PROMPTS", "1")
    records: list[RequestRecord] = []
    call(make_app(records), "/v1/chat/completions", chat_body(), {"authorization": f"Bearer {API_KEY}"})
    line = records[0].to_json(include_prompt=True)
    assert SECRET in line and API_KEY not in line


def test_a_shed_request_is_marked_with_its_tier():
    records: list[RequestRecord] = []
    status, _, _ = call(make_app(records), "/v1/chat/completions", {"busy": True}, {})
    assert status == 429
    [record] = records
    assert record.shed and record.tier == "free" and record.error_code == "overloaded"
    assert record.fallbacks() == []


def test_health_probes_are_not_logged():
    records: list[RequestRecord] = []
    status, _, _ = call(make_app(records), "/health", {}, {})
    assert status == 200 and records == []


def test_the_sink_writes_json_lines_to_the_configured_file(tmp_path, monkeypatch):
    import logging

    from raylane.deployments.gateway import request_log

    path = tmp_path / "requests.jsonl"
    monkeypatch.setenv("RAYLANE_REQUEST_LOG", str(path))
    logger = logging.getLogger("raylane.requests")
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "_raylane_configured", False, raising=False)
    request_log.write(RequestRecord("abc", "POST", "/v1/completions", status=200))
    for handler in logger.handlers:
        handler.flush()
    [line] = path.read_text().splitlines()
    assert json.loads(line)["request_id"] == "abc"
