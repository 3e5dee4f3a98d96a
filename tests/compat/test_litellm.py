"""litellm's SDK with raylane as an `openai/` model: chat, tools, embeddings and the Responses API.
Offline: its price list is the one it ships (LITELLM_LOCAL_MODEL_COST_MAP, set in conftest)."""

import pytest

from tests.compat.conftest import EMBEDDING_MODEL, MODEL

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def litellm():
    import litellm

    litellm.telemetry = False
    return litellm


@pytest.fixture
def target(server) -> dict:
    return {"api_base": server.base_url, "api_key": "unused"}


def test_completion(litellm, target):
    reply = litellm.completion(
        model=f"openai/{MODEL}", messages=QUESTION, temperature=0, max_tokens=16, **target
    )
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.completion_tokens > 0


def test_streamed_completion(litellm, target):
    chunks = litellm.completion(
        model=f"openai/{MODEL}", messages=QUESTION, temperature=0, max_tokens=16, stream=True, **target
    )
    assert "Paris" in "".join(c.choices[0].delta.content or "" for c in chunks)


def test_tool_call(litellm, target):
    reply = litellm.completion(
        model=f"openai/{MODEL}",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=128,
        **target,
    )
    call = reply.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and call.function.arguments == '{"city": "Paris"}'


def test_embedding(litellm, target):
    reply = litellm.embedding(model=f"openai/{EMBEDDING_MODEL}", input=["a cat", "a dog"], **target)
    assert [len(d["embedding"]) for d in reply.data] == [384, 384]
    assert reply.usage.prompt_tokens > 0


def test_responses(litellm, target):
    reply = litellm.responses(
        model=f"openai/{MODEL}",
        input="What is the capital of France?",
        temperature=0,
        max_output_tokens=16,
        **target,
    )
    text = "".join(part.text for item in reply.output if item.type == "message" for part in item.content)
    assert "Paris" in text
