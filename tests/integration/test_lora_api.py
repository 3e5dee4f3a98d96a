"""LoRA adapters through the OpenAI API, with the official SDK: the session app's `chat` pool (the demo
Llama) serves two adapters PEFT made for it, `alpha` and `beta` (tests/live_servers.py)."""

import concurrent.futures

import openai
import pytest

from tests.live_servers import LORA_ADAPTERS

BASE = "raylane-llama-tiny"
HI = [{"role": "user", "content": "Tell me about the sea."}]


def answer(client, model: str, stream: bool = False, **extra) -> tuple[str, str]:
    """(the response's `model`, the greedy answer's text)."""
    args = dict(model=model, messages=HI, max_tokens=12, temperature=0, **extra)
    if not stream:
        response = client.chat.completions.create(**args)
        return response.model, response.choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **args))
    return chunks[0].model, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_models_lists_each_adapter_with_its_base_model(client):
    cards = {m.id: m for m in client.models.list().data}
    for name in LORA_ADAPTERS:
        assert cards[name].model_extra["parent"] == BASE
    assert "parent" not in cards[BASE].model_extra


def test_an_adapter_answers_as_itself_whatever_name_it_is_asked_by(client):
    base = answer(client, BASE)
    alpha, beta = answer(client, "alpha"), answer(client, "beta")
    assert alpha[0] == "alpha" and beta[0] == "beta" and base[0] == BASE
    assert len({base[1], alpha[1], beta[1]}) == 3  # each adapter changes the answer
    assert answer(client, "chat:alpha") == alpha  # the pool's own name for it: the same adapter
    assert answer(client, "alpha", stream=True) == alpha  # streamed: the same text, named the same
    completion = client.completions.create(model="beta", prompt="The sea", max_tokens=8, temperature=0)
    assert completion.model == "beta"
    assert (
        completion.choices[0].text
        != client.completions.create(model=BASE, prompt="The sea", max_tokens=8, temperature=0)
        .choices[0]
        .text
    )


def test_concurrent_requests_for_base_and_adapters_each_get_their_own_answer(client):
    """Twelve requests at once, base and both adapters interleaved: the engine batches them together,
    and each answer is the one its model gives alone."""
    alone = {model: answer(client, model)[1] for model in (BASE, "alpha", "beta")}
    models = [BASE, "alpha", "beta"] * 4
    with concurrent.futures.ThreadPoolExecutor(len(models)) as pool:
        got = list(pool.map(lambda m: answer(client, m, stream=m == "beta"), models))
    assert [text for _, text in got] == [alone[m] for m in models]


def test_an_unknown_adapter_is_a_404_naming_the_models_there_are(client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="chat:gamma", messages=HI, max_tokens=2)
    message = raised.value.body["message"]
    assert "'chat:gamma' does not exist" in message and "'alpha'" in message and "'chat:beta'" in message
