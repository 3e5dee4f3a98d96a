"""Serve the OpenAI API once per test session: two small pools (the demo Llama as `chat`, the demo
Qwen3-MoE as `reasoning`) behind the gateway, on a free local port."""

import socket
import time
from dataclasses import dataclass

import pytest


@dataclass
class ApiServer:
    url: str  # http://127.0.0.1:PORT
    config: object  # the ClusterConfig it serves

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def pool_stats(self, pool: str) -> dict:
        """The pool replica's engine load (each test pool has one replica)."""
        from ray import serve

        from deployments.app import APP_NAME, pool_deployment_name

        handle = serve.get_deployment_handle(pool_deployment_name(pool), app_name=APP_NAME)
        return handle.stats.remote().result(timeout_s=30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_cluster_config(demo_models: dict, port: int):
    from cluster.config import ClusterConfig

    engine = {"max_num_seqs": 16, "num_kv_blocks": 256, "cpus_per_rank": 0.5, "seed": 0}
    return ClusterConfig.from_dict(
        {
            "http": {"host": "127.0.0.1", "port": port},
            "gateway": {"num_cpus": 0.1},
            "pools": [
                {
                    "name": "chat",
                    "model": str(demo_models["raylane-llama-tiny"]),
                    "served_model_name": "raylane-llama-tiny",
                    "engine": engine,
                    "max_n": 4,
                },
                {"name": "reasoning", "model": str(demo_models["raylane-qwen3-moe-tiny"]), "engine": engine},
            ],
        }
    )


@pytest.fixture(scope="session")
def api_server(ray_cluster, demo_models):
    import httpx2
    from ray import serve

    from deployments.app import APP_NAME, build_app

    port = free_port()
    config = make_cluster_config(demo_models, port)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(config), name=APP_NAME, route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx2.get(f"{url}/health", timeout=10).status_code == 200:
                break
        except httpx2.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}/health did not answer 200 within 120 s")
        time.sleep(0.5)
    yield ApiServer(url, config)
    serve.shutdown()


@pytest.fixture
def client(api_server):
    import openai

    return openai.OpenAI(base_url=api_server.base_url, api_key="x", max_retries=0, timeout=120)
