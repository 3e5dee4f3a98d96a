"""LoRA adapters through the OpenAI API, with the official SDK: the session app's `chat` pool (the demo
Llama) serves two adapters PEFT made for it, `alpha` and `beta` (tests/live_servers.py)."""

import concurrent.futures
import shutil
import tempfile
from pathlib import Path

import httpx2
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


def test_an_adapter_loaded_at_run_time_is_served_until_it_is_unloaded(client, api_server, tmp_path):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (the session app is in open mode with
    `allow_runtime_lora_updating`): no replica restarts, and the adapter's answers are its weights'."""
    from raylane.deployments.app import APP_NAME
    from raylane.deployments.gateway.lora_adapters import LoRAAdapters
    from tests.unit.test_lora import make_adapter

    http = httpx2.Client(base_url=api_server.url, timeout=60)
    llama = api_server.config.pool("chat").model
    pid = api_server.pool_stats("chat")["pid"]
    alpha_path = api_server.config.pool("chat").adapters["alpha"]
    gamma_path = str(make_adapter(llama, tmp_path / "gamma", 11, 4, 8, ["k_proj", "up_proj"], False))
    loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "gamma", "lora_path": gamma_path})
    assert loaded.status_code == 200 and "gamma" in loaded.text
    # alpha's weights under another name: alpha's answer, though the engine holds them twice
    again = {"lora_name": "chat:alpha-again", "lora_path": alpha_path}
    assert http.post("/v1/load_lora_adapter", json=again).status_code == 200
    try:
        cards = {m.id: m for m in client.models.list().data}
        assert cards["gamma"].model_extra["parent"] == cards["alpha-again"].model_extra["parent"] == BASE
        gamma = answer(client, "gamma")
        assert gamma[0] == "gamma" and gamma[1] not in (answer(client, BASE)[1], answer(client, "alpha")[1])
        assert answer(client, "alpha-again", stream=True) == ("alpha-again", answer(client, "alpha")[1])
        raw = client.chat.completions.with_raw_response.create(model="gamma", messages=HI, max_tokens=2)
        assert (raw.headers["x-raylane-pool"], raw.headers["x-raylane-adapter"]) == ("chat", "gamma")
        # a gateway replica started now (or another one) serves them too: they are in the GCS
        record = LoRAAdapters(APP_NAME, api_server.config, lambda: None)
        assert record.read()["chat"] == {"gamma": gamma_path, "alpha-again": alpha_path}
        duplicate = http.post("/v1/load_lora_adapter", json={"lora_name": "gamma", "lora_path": alpha_path})
        assert duplicate.status_code == 400 and "already been loaded" in duplicate.json()["error"]["message"]
        # vLLM's load_inplace: `gamma` now runs alpha's weights, under its own name
        inplace = {"lora_name": "gamma", "lora_path": alpha_path, "load_inplace": True}
        assert http.post("/v1/load_lora_adapter", json=inplace).status_code == 200
        assert answer(client, "gamma") == ("gamma", answer(client, "alpha")[1])
        over_config = http.post("/v1/load_lora_adapter", json=inplace | {"lora_name": "alpha"})
        assert over_config.status_code == 400  # a config adapter is the config's to change
        in_config = http.post("/v1/unload_lora_adapter", json={"lora_name": "alpha"})
        assert in_config.status_code == 400 and "cluster config" in in_config.json()["error"]["message"]
    finally:
        for name in ("gamma", "alpha-again"):
            assert http.post("/v1/unload_lora_adapter", json={"lora_name": name}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        answer(client, "gamma")
    gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "gamma"})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_name"
    assert answer(client, "alpha")[0] == "alpha"  # the config's adapters are untouched
    assert api_server.pool_stats("chat")["pid"] == pid  # served without a restart


def test_an_adapter_the_pool_could_not_run_is_refused_when_it_is_loaded(api_server, tmp_path):
    from tests.unit.test_lora import make_adapter

    http = httpx2.Client(base_url=api_server.url, timeout=60)
    llama = api_server.config.pool("chat").model
    too_wide = str(make_adapter(llama, tmp_path / "wide", 3, 32, 32, ["q_proj"], False))  # max_lora_rank 16
    outside = Path(tempfile.mkdtemp(dir="/var/tmp"))  # beyond gateway.lora_adapter_roots (/tmp)
    try:
        fine = make_adapter(llama, outside / "fine", 3, 4, 8, ["q_proj"], False)
        (tmp_path / "link").symlink_to(fine)  # inside a root, resolving outside it
        for path, says in (
            ("relative/dir", "absolute"),
            (str(tmp_path / "nowhere"), "nowhere"),
            (too_wide, "rank"),
            (str(fine), "outside the directories"),
            (str(tmp_path / "link"), "outside the directories"),
        ):
            refused = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": path})
            error = refused.json()["error"]
            assert refused.status_code == 400 and error["param"] == "lora_path" and says in error["message"]
    finally:
        shutil.rmtree(outside)
    reasoning = http.post("/v1/load_lora_adapter", json={"lora_name": "reasoning:x", "lora_path": too_wide})
    assert reasoning.status_code == 400 and "serves no LoRA adapters" in reasoning.json()["error"]["message"]
    assert "bad" not in {m["id"] for m in http.get("/v1/models").json()["data"]}


def test_only_keys_of_an_admin_tier_may_load_adapters(router_server):
    """The router app has API keys; its `premium` tier is `admin`. Its pools serve no adapters, so an
    admin's load is refused for that, after the key was let through."""
    from tests.live_servers import ROUTER_KEYS

    http = httpx2.Client(base_url=router_server.url, timeout=60)
    body = {"lora_name": "x", "lora_path": "/adapters/x", "pool": "chat"}
    for tier in ("standard", "free"):
        headers = {"Authorization": f"Bearer {ROUTER_KEYS[tier]}"}
        refused = http.post("/v1/load_lora_adapter", json=body, headers=headers)
        assert refused.status_code == 403 and "admin" in refused.json()["error"]["message"]
    assert http.post("/v1/unload_lora_adapter", json=body).status_code == 401
    admin = {"Authorization": f"Bearer {ROUTER_KEYS['premium']}"}
    refused = http.post("/v1/load_lora_adapter", json=body, headers=admin)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "pool"
