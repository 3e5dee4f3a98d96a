"""llama-index's OpenAILike (the class its docs give for vLLM and other OpenAI-compatible servers):
complete and chat, whole and streamed."""

import pytest

from tests.compat.conftest import MODEL


@pytest.fixture
def llm(server):
    from llama_index.llms.openai_like import OpenAILike

    return OpenAILike(
        model=MODEL,
        api_base=server.base_url,
        api_key="unused",
        is_chat_model=True,
        context_window=2048,
        temperature=0,
        max_tokens=16,
        max_retries=0,
    )


def test_chat(llm):
    from llama_index.core.llms import ChatMessage

    reply = llm.chat([ChatMessage(role="user", content="What is the capital of France?")])
    assert "Paris" in reply.message.content


def test_stream_chat(llm):
    from llama_index.core.llms import ChatMessage

    chunks = list(llm.stream_chat([ChatMessage(role="user", content="What is the capital of France?")]))
    assert len(chunks) > 1 and "Paris" in chunks[-1].message.content


def test_complete(server):
    """A completion model: `complete` goes to /v1/completions with the prompt as it is."""
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(
        model=MODEL,
        api_base=server.base_url,
        api_key="unused",
        is_chat_model=False,
        temperature=0,
        max_tokens=4,
    )
    assert "Paris" in llm.complete("The capital of France is").text
