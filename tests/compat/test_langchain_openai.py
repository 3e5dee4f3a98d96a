"""langchain-openai against raylane: ChatOpenAI (invoke, stream, tools, structured output by function
calling and by json_schema, the Responses API) and OpenAIEmbeddings with its defaults."""

import math

import pytest
from pydantic import BaseModel, Field

from tests.compat.conftest import EMBEDDING_MODEL, MODEL

QUESTION = "What is the capital of France?"


class Capital(BaseModel):
    """A country's capital."""

    city: str = Field(description="the capital city")
    country: str


def chat_model(server, max_tokens: int = 24, **kwargs):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=MODEL,
        base_url=server.base_url,
        api_key="unused",
        temperature=0,
        max_tokens=max_tokens,
        **kwargs,
    )


@pytest.fixture
def chat(server):
    return chat_model(server)


def test_invoke(chat):
    assert "Paris" in chat.invoke(QUESTION).text


def test_stream_equals_invoke(chat):
    chunks = [chunk.text for chunk in chat.stream(QUESTION)]
    assert len(chunks) > 1 and "".join(chunks) == chat.invoke(QUESTION).text


def test_bind_tools_gives_a_tool_call(server):
    """A forced call takes ~50 tokens here: the grammar lets SmolLM2 spell the markup a few
    characters a token."""
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"Sunny in {city}"

    chat = chat_model(server, max_tokens=128)
    reply = chat.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert [(c["name"], c["args"]) for c in reply.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert get_weather.invoke(reply.tool_calls[0]).content == "Sunny in Paris"


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_with_structured_output(server, method):
    """function_calling forces a call of a tool named after the model class (SmolLM2's template does
    not show it the tool, so its values are a guess; that they parse is raylane's part);
    json_schema sends response_format, which the answer follows."""
    structured = chat_model(server, max_tokens=128).with_structured_output(Capital, method=method)
    answer = structured.invoke(QUESTION)
    assert isinstance(answer, Capital)
    if method == "json_schema":
        assert answer == Capital(city="Paris", country="France")


def test_responses_api(server):
    reply = chat_model(server, use_responses_api=True).invoke(QUESTION)
    assert "Paris" in reply.text
    assert reply.response_metadata.get("id", "").startswith("resp")


def test_embeddings_with_defaults_send_token_ids(server, openai_client):
    """OpenAIEmbeddings' default path tokenizes with tiktoken (cl100k_base for a model tiktoken does
    not know) and sends token-id arrays. raylane, like vLLM, reads ids in the embedding model's own
    vocabulary, so these vectors are of other words: the request succeeds, and
    check_embedding_ctx_length=False (langchain's advice for OpenAI-compatible servers) sends the text."""
    import tiktoken
    from langchain_openai import OpenAIEmbeddings

    texts = ["a cat sat on the mat", "stock prices fell"]
    assert (
        max(max(tiktoken.get_encoding("cl100k_base").encode(t)) for t in texts) < 30522
    )  # MiniLM's vocabulary
    defaults = OpenAIEmbeddings(model=EMBEDDING_MODEL, base_url=server.base_url, api_key="unused")
    vectors = defaults.embed_documents(texts)
    assert [len(v) for v in vectors] == [384, 384]
    by_text = OpenAIEmbeddings(
        model=EMBEDDING_MODEL, base_url=server.base_url, api_key="unused", check_embedding_ctx_length=False
    )
    expected = [d.embedding for d in openai_client.embeddings.create(model=EMBEDDING_MODEL, input=texts).data]
    assert all(_cosine(a, b) > 0.9999 for a, b in zip(by_text.embed_documents(texts), expected, strict=True))


def _cosine(a, b) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))
