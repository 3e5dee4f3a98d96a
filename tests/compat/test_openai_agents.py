"""openai-agents (the OpenAI Agents SDK) with raylane as its model: the Responses and the Chat
Completions model classes, a function tool, and a streamed run. Tracing is off (it would upload)."""

import asyncio

import pytest

from tests.compat.conftest import MODEL


@pytest.fixture(scope="module")
def agents_sdk():
    import agents

    agents.set_tracing_disabled(True)
    return agents


@pytest.fixture(params=["responses", "chat_completions"])
def model(request, server, agents_sdk):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    if request.param == "responses":
        return agents_sdk.OpenAIResponsesModel(model=MODEL, openai_client=client)
    return agents_sdk.OpenAIChatCompletionsModel(model=MODEL, openai_client=client)


def test_agent_answers(agents_sdk, model):
    agent = agents_sdk.Agent(
        name="geo",
        instructions="Answer in one short sentence.",
        model=model,
        model_settings=agents_sdk.ModelSettings(temperature=0, max_tokens=24),
    )
    result = asyncio.run(agents_sdk.Runner.run(agent, "What is the capital of France?"))
    assert "Paris" in result.final_output


def test_agent_calls_a_function_tool_and_answers_from_its_result(agents_sdk, model):
    """The first call is forced (a 135M model rarely picks a tool by itself; the SDK then resets
    tool_choice): raylane constrains it to the tool's schema, the SDK runs the tool and sends its
    result back (a `tool` message, or a `function_call_output` item), and the model answers."""
    calls = []

    @agents_sdk.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny in {city}, 21 C"

    agent = agents_sdk.Agent(
        name="weather",
        instructions="Use the tool, then answer in one sentence.",
        model=model,
        tools=[get_weather],
        model_settings=agents_sdk.ModelSettings(temperature=0, max_tokens=48, tool_choice="required"),
    )
    result = asyncio.run(agents_sdk.Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    assert calls == ["Paris"]
    assert "Sunny" in result.final_output


def test_streamed_run_delivers_the_text_as_deltas(agents_sdk, model):
    from openai.types.responses import ResponseTextDeltaEvent

    agent = agents_sdk.Agent(
        name="geo",
        instructions="Answer in one short sentence.",
        model=model,
        model_settings=agents_sdk.ModelSettings(temperature=0, max_tokens=24),
    )

    async def run():
        result = agents_sdk.Runner.run_streamed(agent, "What is the capital of France?")
        deltas = [
            event.data.delta
            async for event in result.stream_events()
            if event.type == "raw_response_event" and isinstance(event.data, ResponseTextDeltaEvent)
        ]
        return deltas, result.final_output

    deltas, final = asyncio.run(run())
    assert len(deltas) > 1 and "".join(deltas) == final
    assert "Paris" in final
