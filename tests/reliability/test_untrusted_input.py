"""Bad input, from anyone: a property-based fuzz of the OpenAPI document the gateway publishes, and
each limit on what one request may ask for.

The fuzz (schemathesis over /openapi.json, positive and negative cases) sends at least 1,000
requests to /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses (and GET/DELETE of
a stored one), /tokenize, /detokenize, /v1/models, the Batch API's routes (files', batches') and
vLLM's LoRA adapter routes:
no 5xx, every 4xx in OpenAI's error shape, every 2xx valid against the schema the gateway
publishes (a stream: JSON events then [DONE], or the Responses API's typed events ending in
response.completed / response.incomplete; no error event).
The app under test is an ordinary one with a 64-token context window, so that generated requests
that are valid (positive cases name a served `model`; negative ones may not) reach the engine and
cost at most 64 tokens each. The cases are the same every run (derandomized), so a failure
reproduces; the figures are reported at the end of the run.
"""

import json
import time
from collections import Counter

import httpx2
import pytest
import requests

from tests.reliability.conftest import deployed, llama_pool

APP = "untrusted"
CONTEXT = 64  # tokens: the pool's max_model_len
BODY_LIMIT = 256 * 1024  # gateway.max_request_body_bytes here (default 8 MiB)
BATCH_LIMIT = 32  # gateway.max_batch_prompts here
EMBEDDING_MODEL = "all-MiniLM-L6-v2"
MIN_FUZZ_REQUESTS = 1000
# (method, path, examples): Hypothesis examples per operation, each one request.
FUZZ = [
    ("POST", "/v1/chat/completions", 280),
    ("POST", "/v1/completions", 240),
    ("POST", "/v1/embeddings", 170),
    ("GET", "/v1/models/{model_id}", 80),
    ("POST", "/v1/responses", 130),
    ("GET", "/v1/responses/{response_id}", 30),
    ("DELETE", "/v1/responses/{response_id}", 20),
    ("POST", "/tokenize", 80),
    ("POST", "/detokenize", 60),
    ("GET", "/v1/models", 1),  # no parameters: one request says it all
    ("POST", "/v1/batches", 40),
    ("GET", "/v1/batches", 1),
    ("GET", "/v1/batches/{batch_id}", 10),
    ("POST", "/v1/batches/{batch_id}/cancel", 10),
    ("POST", "/v1/files", 1),
    ("GET", "/v1/files", 1),
    ("GET", "/v1/files/{file_id}", 10),
    ("DELETE", "/v1/files/{file_id}", 10),
    ("POST", "/v1/load_lora_adapter", 10),  # open mode without allow_runtime_lora_updating: 403s
    ("POST", "/v1/unload_lora_adapter", 10),
]
STATUSES: dict[str, Counter] = {}  # "METHOD path" -> status -> requests
ERRORS: Counter = Counter()  # (generation mode, status, code, param) of the 4xx answers
STARTED: list[float] = []


@pytest.fixture(scope="module")
def untrusted(api_server, demo_models, tmp_path_factory):
    batch_dir = tmp_path_factory.mktemp("batch")
    config = {
        "batch": {"store": str(batch_dir / "b.sqlite3"), "files_dir": str(batch_dir / "files")},
        "gateway": {"num_cpus": 0.1, "max_request_body_bytes": BODY_LIMIT, "max_batch_prompts": BATCH_LIMIT},
        "pools": [llama_pool(demo_models, "chat", engine={"max_model_len": CONTEXT}, max_n=4)],
        "embeddings": {"enabled": True},  # fuzzed too
        # Open mode, one tier without rate limits: the fuzz is one client sending fast.
        "tiers": [
            {"name": "open", "priority": 0, "max_queue_depth": 64, "max_queue_wait_s": 60, "batches": True}
        ],
        "api_keys": {"default_tier": "open"},
    }
    with deployed(api_server, APP, config) as url:
        yield url


@pytest.fixture(scope="module")
def http(untrusted):
    with httpx2.Client(base_url=untrusted, timeout=120) as client:
        yield client


def content_type(response) -> str:
    """The Content-Type of an httpx or a schemathesis response (whose headers hold lists)."""
    value = next((v for k, v in response.headers.items() if k.lower() == "content-type"), "")
    return value[0] if isinstance(value, list) else value


def assert_openai_error(response, status: int | None = None) -> dict:
    """OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}, a message that says something."""
    if status is not None:
        assert response.status_code == status, response.text[:500]
    assert content_type(response).startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"].strip(), error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error
    return error


# -- the fuzz ------------------------------------------------------------------------------------


def _served_models(schema: dict, chat_models: list[str], embedding_models: list[str]) -> dict:
    """Positive cases name a model the app serves (else nearly every request would end at the 404 for
    an unknown model); negative cases still send other values."""
    components = schema["components"]["schemas"]
    for name, models in (
        ("ChatCompletionRequest", chat_models),
        ("CompletionRequest", chat_models),
        ("EmbeddingRequest", embedding_models),
        ("ResponsesRequest", chat_models),
        ("TokenizeChatRequest", chat_models),
        ("TokenizeCompletionRequest", chat_models),
        ("DetokenizeRequest", chat_models),
    ):
        components[name]["properties"]["model"] = {"enum": models}
    return schema


@pytest.fixture(scope="module")
def fuzz_schema(untrusted, http):
    import schemathesis

    document = http.get("/openapi.json")
    assert document.status_code == 200
    schema = document.json()
    for path, operation in (
        ("/v1/chat/completions", "post"),
        ("/v1/completions", "post"),
        ("/v1/embeddings", "post"),
        ("/v1/responses", "post"),
        ("/tokenize", "post"),
        ("/detokenize", "post"),
    ):
        body = schema["paths"][path][operation]["requestBody"]  # published, not only parsed
        published = body["content"]["application/json"]["schema"]
        assert body["required"] and ("$ref" in published or "anyOf" in published)
    chat_models = ["chat", "auto"]
    schema = _served_models(schema, chat_models, [EMBEDDING_MODEL])
    loaded = schemathesis.openapi.from_dict(schema)
    loaded.config.max_stream_events = 10_000  # read whole streams (schemathesis stops at 20 events)
    return loaded


def check_openai_errors(ctx, response, case) -> None:
    """A schemathesis check: every 4xx and 5xx is OpenAI's error JSON."""
    if response.status_code >= 400:
        error = assert_openai_error(response)
        ERRORS[(case.meta.generation.mode.value, response.status_code, error["code"], error["param"])] += 1


def check_stream(ctx, response, case) -> None:
    """A 200 stream is JSON events then [DONE]: an error event would be a failure hidden in a 200."""
    if response.status_code != 200 or not content_type(response).startswith("text/event-stream"):
        return
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    if case.path == "/v1/responses":  # typed events, no [DONE]
        data = [json.loads(event) for event in events]
        assert all("error" not in d and d["type"].startswith("response.") for d in data), data
        assert data[-1]["type"] in ("response.completed", "response.incomplete"), data[-1]
        return
    assert events and events[-1] == "[DONE]", response.text[-500:]
    for event in events[:-1]:
        data = json.loads(event)
        assert "error" not in data, data
        assert data["object"] in ("chat.completion.chunk", "text_completion"), data


@pytest.mark.parametrize(("method", "path", "examples"), FUZZ, ids=[f"{m} {p}" for m, p, _ in FUZZ])
def test_fuzz_the_published_schema(fuzz_schema, untrusted, method, path, examples):
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance

    operation = fuzz_schema[path][method]
    modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if method == "POST" else [])
    strategy = st.one_of(*(operation.as_strategy(generation_mode=mode) for mode in modes))
    statuses = STATUSES.setdefault(f"{method} {path}", Counter())
    if not STARTED:
        STARTED.append(time.monotonic())
    session = requests.Session()

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,  # the same requests every run: a failure here reproduces
        database=None,
        phases=[Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def run(case) -> None:
        response = case.call(base_url=untrusted, session=session, timeout=120)
        statuses[response.status_code] += 1
        case.validate_response(
            response,
            checks=[not_a_server_error, response_schema_conformance, content_type_conformance],
            additional_checks=[check_openai_errors, check_stream],
        )

    run()
    assert sum(statuses.values()) >= examples


def test_fuzz_figures(report, capsys):
    """At least 1,000 generated requests in all, none answered with a 5xx (for docs/reliability.md)."""
    if len(STATUSES) != len(FUZZ):
        pytest.skip("runs after every fuzz test")
    total = Counter()
    for statuses in STATUSES.values():
        total.update(statuses)
    requests_sent = sum(total.values())
    histogram = {str(status): total[status] for status in sorted(total)}
    seconds = round(time.monotonic() - STARTED[0], 1)
    report("fuzz (schemathesis)", requests=requests_sent, statuses=histogram, seconds=seconds)
    with capsys.disabled():
        print(f"\nfuzz: {requests_sent} requests in {seconds} s, statuses {histogram}")
        for name, statuses in STATUSES.items():
            print(f"  {name}: {dict(sorted(statuses.items()))}")
        print("  most common errors (mode, status, code, param):", ERRORS.most_common(12))
    assert requests_sent >= MIN_FUZZ_REQUESTS
    assert not [s for s in total if s >= 500]
    assert total[200] > 100, "too few generated requests were valid: the fuzz barely reached the engine"


# -- the limits, one by one ------------------------------------------------------------------------

HI = [{"role": "user", "content": "hi"}]


def chat(http, **body):
    return http.post("/v1/chat/completions", json={"model": "chat", "messages": HI, "max_tokens": 1, **body})


def test_a_body_over_the_limit_is_413_before_it_is_parsed(http):
    big = json.dumps({"model": "chat", "messages": [{"role": "user", "content": "x" * BODY_LIMIT}]})
    error = assert_openai_error(http.post("/v1/chat/completions", content=big), 413)
    assert error["code"] == "request_too_large" and str(BODY_LIMIT) in error["message"], error
    # Not JSON at all: still 413, not 400 invalid_json, so the size is checked before any parsing.
    r = http.post("/v1/completions", content=b"{" * (BODY_LIMIT + 1))
    assert assert_openai_error(r, 413)["code"] == "request_too_large"

    def chunks(total: int, size: int = 16 * 1024):  # no Content-Length: sent chunked
        head = b'{"model": "chat", "prompt": "'
        yield head
        for _ in range(total // size):
            yield b"x" * size
        yield b'"}'

    r = http.post("/v1/completions", content=chunks(BODY_LIMIT + 64 * 1024))
    assert (
        r.request.headers.get("transfer-encoding") == "chunked" and "content-length" not in r.request.headers
    )
    assert assert_openai_error(r, 413)["code"] == "request_too_large"
    r = http.post("/v1/embeddings", content=chunks(4 * BODY_LIMIT))
    assert assert_openai_error(r, 413)["code"] == "request_too_large"
    # Under the limit, a chunked body is read whole and served.
    small = json.dumps({"model": "chat", "messages": HI, "max_tokens": 1}).encode()
    r = http.post("/v1/chat/completions", content=iter([small[:10], small[10:]]))
    assert r.status_code == 200, r.text


CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
TOO_LONG, WINDOW = "context_length_exceeded", str(CONTEXT)
LOOP = "{% for i in range(99999) %}{% for j in range(99999) %}x{% endfor %}{% endfor %}"
# (path, body, the param the error names, its code if a specific one, what its message says)
LIMITS = [
    # the context window: the prompt, and the prompt plus what is asked for
    (CHAT, {"messages": [{"role": "user", "content": "word " * 200}]}, "messages", TOO_LONG, WINDOW),
    (COMPLETIONS, {"prompt": "word " * 200}, "prompt", TOO_LONG, WINDOW),
    (CHAT, {"max_tokens": CONTEXT}, "max_tokens", TOO_LONG, WINDOW),
    (CHAT, {"max_tokens": None, "max_completion_tokens": 10**30}, "max_completion_tokens", TOO_LONG, WINDOW),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 10**12}, "max_tokens", TOO_LONG, WINDOW),
    # counts and sizes
    (CHAT, {"n": 5}, "n", None, "4"),  # the pool's max_n
    (CHAT, {"messages": HI * 2049}, "messages", None, "2048"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools",
     None, "128"),
    (CHAT, {"stop": ["a", "b", "c", "d", "e"]}, "stop", None, "4"),
    (CHAT, {"stop": ["x" * 257]}, "stop", None, "256"),
    (COMPLETIONS, {"prompt": "hi", "stop_token_ids": list(range(257))}, "stop_token_ids", None, "256"),
    (COMPLETIONS, {"prompt": ["hi"] * (BATCH_LIMIT + 1)}, "prompt", None, str(BATCH_LIMIT)),
    (EMBEDDINGS, {"model": EMBEDDING_MODEL, "input": ["a"] * 2049}, "input", None, "2048"),
    (CHAT, {"logit_bias": {"1": 5}}, "logit_bias", "unsupported_parameter", "not supported"),
    # a template of the client's would run in the pool replica
    (CHAT, {"chat_template_kwargs": {"chat_template": LOOP}}, "chat_template_kwargs", None, "chat_template"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param", "code", "says"), LIMITS)
def test_each_limit_is_a_400_naming_its_parameter(http, path, body, param, code, says):
    base = {CHAT: {"model": "chat", "messages": HI, "max_tokens": 1}, COMPLETIONS: {"model": "chat"}}.get(
        path, {}
    )
    r = http.post(path, json={k: v for k, v in (base | body).items() if v is not None})
    error = assert_openai_error(r, 400)
    assert error["param"] == param and says in error["message"], error
    if code is not None:
        assert error["code"] == code, error


def test_json_nested_too_deeply_is_a_400(http):
    nested: object = "x"
    for _ in range(100):
        nested = {"a": nested}
    error = assert_openai_error(chat(http, metadata=nested), 400)
    assert error["code"] == "invalid_json" and "64" in error["message"], error
    # deeper than Python's JSON decoder goes (it raises RecursionError, once a bare 500)
    r = http.post("/v1/chat/completions", content=b"[" * 50_000)
    assert assert_openai_error(r, 400)["code"] == "invalid_json"


def test_within_the_limits_a_request_is_served(http):
    r = chat(
        http, n=4, stop=["x" * 256], max_tokens=CONTEXT // 2, chat_template_kwargs={"enable_thinking": False}
    )
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 4
