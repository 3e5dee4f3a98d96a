"""pydantic-ai with raylane behind its OpenAI chat model: structured output (its default, an output
tool; and NativeOutput, a json_schema response format) and a function tool."""

from dataclasses import dataclass

import pytest
from pydantic import BaseModel, Field

from tests.compat.conftest import MODEL


class Capital(BaseModel):
    city: str = Field(description="the capital city")
    country: str


@pytest.fixture
def model(server):
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    return OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=server.base_url, api_key="unused"))


def test_output_tool_returns_a_valid_model(model):
    """The default output mode: a forced call of pydantic-ai's `final_result` tool, constrained by its
    schema. SmolLM2's chat template does not show tools to the model, so the values are the model's
    guess (it copies the tool's name); that they parse is raylane's part. parallel_tool_calls=False:
    with parallel calls allowed this model repeats the call until max_tokens."""
    from pydantic_ai import Agent

    settings = {"temperature": 0, "max_tokens": 128, "parallel_tool_calls": False}
    result = Agent(model, output_type=Capital, model_settings=settings).run_sync(
        "What is the capital of France?"
    )
    assert isinstance(result.output, Capital)


def test_native_output_answers_in_the_schema(model):
    from pydantic_ai import Agent, NativeOutput

    agent = Agent(
        model, output_type=NativeOutput(Capital), model_settings={"temperature": 0, "max_tokens": 64}
    )
    result = agent.run_sync("What is the capital of France?")
    assert result.output == Capital(city="Paris", country="France")


def test_function_tool_result_reaches_the_answer(model):
    from pydantic_ai import Agent
    from pydantic_ai.capabilities import AbstractCapability

    @dataclass
    class ToolOnFirstStep(AbstractCapability):
        """pydantic-ai's way to force a tool on the first step only (a static 'required' would loop)."""

        def get_model_settings(self):
            return lambda ctx: {"tool_choice": ["get_weather"]} if ctx.run_step <= 1 else {}

    agent = Agent(
        model,
        instructions="Use the tool, then answer in one sentence.",
        model_settings={"temperature": 0, "max_tokens": 48},
        capabilities=[ToolOnFirstStep()],
    )
    calls = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny in {city}, 21 C"

    result = agent.run_sync("What is the weather in Paris?")
    parts = [type(p).__name__ for m in result.all_messages() for p in m.parts]
    assert parts == ["UserPromptPart", "ToolCallPart", "ToolReturnPart", "TextPart"]
    assert calls == ["Paris"] and "Sunny" in result.output
