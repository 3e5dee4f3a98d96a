"""Stored responses (`/v1/responses` with `store`) live in a detached Ray actor, not in the gateway:
a response outlives the gateway replica that stored it (killed here; Serve starts another), and the
store keeps only `gateway.responses_max_stored` responses, the newest."""

import openai
import pytest

from tests.live_servers import wait_healthy, wait_until
from tests.reliability.conftest import deployed, llama_pool, replica_names

APP = "responses-store"
MAX_STORED = 3
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def app(api_server, demo_models):
    import ray

    from raylane.deployments.gateway.response_store import NAMESPACE, store_name
    from raylane.deployments.metrics.aggregator import aggregator_name

    config = {
        "gateway": {"num_cpus": 0.1, "responses_max_stored": MAX_STORED},
        "pools": [llama_pool(demo_models, "chat")],
    }
    with deployed(api_server, APP, config) as url:
        yield url
        ray.get_actor(aggregator_name(APP), namespace=NAMESPACE)  # made by the replicas' reports
    # Deleting the app (deployments/app.py: delete_app) ended its detached actors: each would
    # otherwise idle on, a Ray worker process apiece, for as long as the cluster runs.
    for name in (store_name(APP), aggregator_name(APP)):
        with pytest.raises(ValueError):
            ray.get_actor(name, namespace=NAMESPACE)


@pytest.fixture(scope="module")
def client(app):
    return openai.OpenAI(base_url=f"{app}/v1", api_key="x", max_retries=0, timeout=120)


def test_a_stored_response_outlives_its_gateway_replica(app, client):
    import ray

    first = client.responses.create(model="chat", input="My name is Ada.", max_output_tokens=4)
    [victim] = replica_names(APP, "Gateway")
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    wait_until(lambda: replica_names(APP, "Gateway") not in ([], [victim]), 120, "a new gateway replica")
    wait_healthy(f"{app}/health", 120)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(
        model="chat", previous_response_id=first.id, input="What is my name?", max_output_tokens=4
    )
    assert second.previous_response_id == first.id and second.status in ("completed", "incomplete")


def test_the_store_keeps_the_newest_responses(client):
    ids = [client.responses.create(model="chat", input=f"n{i}", max_output_tokens=1).id for i in range(4)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
