"""instructor's modes against raylane: TOOLS (a forced tool call), JSON_SCHEMA (response_format
json_schema) and RESPONSES_TOOLS (the Responses API with a forced tool and, as instructor sends it,
a json_schema text format beside it). Each must give back a valid pydantic model."""

import pytest
from pydantic import BaseModel, Field

from tests.compat.conftest import MODEL

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


class Capital(BaseModel):
    """A country's capital."""

    city: str = Field(description="the capital city")
    country: str


@pytest.fixture
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_chat_modes(client, mode):
    """TOOLS forces a call of a tool named after the class (SmolLM2's template does not show it the
    tool, so its values are a guess: that they parse is raylane's part); JSON_SCHEMA's answer follows
    the schema and the question."""
    import instructor

    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    answer = patched.chat.completions.create(
        model=MODEL, messages=QUESTION, response_model=Capital, max_retries=0, temperature=0, max_tokens=128
    )
    assert isinstance(answer, Capital)
    if mode == "JSON_SCHEMA":
        assert answer.model_dump() == {"city": "Paris", "country": "France"}


def test_responses_tools_mode(client):
    import instructor

    patched = instructor.from_openai(client, mode=instructor.Mode.RESPONSES_TOOLS)
    answer = patched.responses.create(
        model=MODEL,
        input=QUESTION,
        response_model=Capital,
        max_retries=0,
        temperature=0,
        max_output_tokens=128,
    )
    assert isinstance(answer, Capital)
