"""Live apps for integration and reliability tests (fixtures registered in tests/conftest.py).

Serve the OpenAI API once per test session: three small pools (the demo Llama as `chat`, with two
LoRA adapters PEFT makes for it, the demo Qwen3-MoE as `reasoning`, with the `qwen3` reasoning
parser, a simulated engine as `sim`) behind the gateway, on a free local port. Router tests get a
second app on the same Serve (`router_server`, under /router): API keys, tiers, routes, tiny pool
capacities, and pools whose failures a test can switch on."""

import contextlib
import os
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from raylane.bench import apps
from raylane.cluster.serve_env import free_port, free_ports  # noqa: F401  (the tests' import of them)


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

        from raylane.deployments.app import APP_NAME, pool_deployment_name

        handle = serve.get_deployment_handle(pool_deployment_name(pool), app_name=APP_NAME)
        return handle.stats.remote().result(timeout_s=30)


LORA_ADAPTERS = {
    "alpha": (4, ["q_proj", "v_proj"]),
    "beta": (8, ["o_proj", "gate_proj", "up_proj", "down_proj"]),
}


def make_cluster_config(demo_models: dict, port: int):
    from raylane.config import ClusterConfig
    from tests.unit.test_lora import make_adapter

    engine = {"max_num_seqs": 16, "num_kv_blocks": 256, "cpus_per_rank": 0.5, "seed": 0}
    batch_dir = tempfile.mkdtemp(prefix="raylane-batch-")  # this session's batches only
    llama = str(demo_models["raylane-llama-tiny"])
    adapters = {
        name: str(make_adapter(llama, Path(batch_dir) / "lora" / name, seed, rank, 2 * rank, targets, False))
        for seed, (name, (rank, targets)) in enumerate(LORA_ADAPTERS.items())
    }
    return ClusterConfig.from_dict(
        {
            "http": {"host": "127.0.0.1", "port": port},
            # open mode: anyone may load LoRA adapters at run time (test_lora_api.py)
            "gateway": {
                "num_cpus": 0.1,
                "allow_runtime_lora_updating": True,
                "lora_adapter_roots": [tempfile.gettempdir()],  # the tests' adapters, not /var/tmp
            },
            # a line's call lost with a killed gateway replica is given up well within the tests' waits
            "batch": {
                "store": f"{batch_dir}/batch.sqlite3",
                "files_dir": f"{batch_dir}/files",
                "line_timeout_s": 30,
            },
            "pools": [
                {
                    "name": "chat",
                    "model": llama,
                    "served_model_name": "raylane-llama-tiny",
                    "adapters": adapters,
                    "engine": engine,
                    "max_n": 4,
                    "grammar_compile_timeout_s": 3.0,  # test_bad_input's costly grammar, well past it
                },
                {
                    "name": "reasoning",
                    "model": str(demo_models["raylane-qwen3-moe-tiny"]),
                    "engine": engine,
                    "reasoning_parser": "qwen3",  # <think> parsed out (test_reasoning_output.py)
                },
                # a simulated engine (engine/sim/): no weights, step times from its profile (test_sim_pool.py)
                {"name": "sim", "model": "sim:llama-3.1-8b-h100", "engine": {"cpus_per_rank": 0.1}},
            ],
        }
    )


@pytest.fixture(scope="session")
def api_server(ray_cluster, demo_models):
    from ray import serve

    from raylane.deployments.app import APP_NAME, build_app

    port = free_port()
    config = make_cluster_config(demo_models, port)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(config), name=APP_NAME, route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    wait_healthy(f"{url}/health", 120)
    yield ApiServer(url, config)
    serve.shutdown()


@pytest.fixture
def client(api_server):
    import openai

    return openai.OpenAI(base_url=api_server.base_url, api_key="x", max_retries=0, timeout=120)


ROUTER_APP = "raylane-router"
ROUTER_PREFIX = "/router"
ROUTER_KEYS = {"premium": "premium-key", "standard": "standard-key", "free": "free-key"}
LIMITED_KEY = "limited-key"  # tier `limited`: one request a minute (the rate limit's own tests)


@dataclass
class RouterServer:
    url: str  # http://127.0.0.1:PORT/router
    config: object

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def set_fault(self, pool: str, fault: str | None) -> None:
        """See tests/integration/faulty_pool.py."""
        from ray import serve

        from raylane.deployments.app import pool_deployment_name

        handle = serve.get_deployment_handle(pool_deployment_name(pool), app_name=ROUTER_APP)
        handle.set_fault.remote(fault).result(timeout_s=30)


def make_router_config(demo_models: dict, port: int):
    """Three pools of the demo Llama: `coding` (falls back to chat), `reasoning` with a 64-token
    context (falls back to chat) and `chat` (one request at a time, no fallback); four keyed tiers,
    `free` sheddable with no queue (and no batches), `limited` one request a minute; a circuit breaker
    that opens after 2 failures for 2 s."""
    from raylane.config import ClusterConfig, default_routes

    llama = str(demo_models["raylane-llama-tiny"])
    engine = {"max_num_seqs": 8, "num_kv_blocks": 64, "cpus_per_rank": 0.5, "seed": 0}
    fallbacks = {"coding": ["chat"], "reasoning": ["chat"], "chat": []}
    routes = [r.model_dump() | {"fallbacks": fallbacks[r.name]} for r in default_routes()]
    wait = {"max_queue_depth": 16, "max_queue_wait_s": 300}
    free = {"name": "free", "priority": 2, "max_queue_depth": 0, "max_queue_wait_s": 1, "sheddable": True}
    batch_dir = tempfile.mkdtemp(prefix="raylane-router-batch-")
    return ClusterConfig.from_dict(
        {
            "http": {"host": "127.0.0.1", "port": port},
            "gateway": {"num_cpus": 0.1, "pool_health_period_s": 0.5},
            "embeddings": {"enabled": False},
            "batch": {
                "store": f"{batch_dir}/batch.sqlite3",
                "files_dir": f"{batch_dir}/files",
                "line_timeout_s": 5,  # test_batch_api's held line (its lines here take under a second)
                "max_concurrent_uploads_per_key": 1,  # test_batch_api's parallel uploads
            },
            "pools": [
                {"name": "coding", "model": llama, "engine": engine, "max_in_flight": 2},
                {"name": "reasoning", "model": llama, "engine": engine | {"max_model_len": 64}},
                {"name": "chat", "model": llama, "engine": engine, "max_in_flight": 1},
            ],
            "router": {"routes": routes, "circuit_breaker": {"failure_threshold": 2, "cooldown_s": 2.0}},
            "tiers": [
                {"name": "premium", "priority": 0, "admin": True, "batches": True, **wait},
                {"name": "standard", "priority": 1, "batches": True, **wait},
                free,
                {"name": "limited", "priority": 1, "requests_per_minute": 1, **wait},
            ],
            "api_keys": {"keys": {key: tier for tier, key in ROUTER_KEYS.items()} | {LIMITED_KEY: "limited"}},
        }
    )


@pytest.fixture(scope="session")
def router_server(api_server, demo_models):
    from ray import serve

    from raylane.deployments.app import delete_app
    from tests.integration.faulty_pool import FaultyPool

    config = make_router_config(demo_models, int(api_server.url.rsplit(":", 1)[1]))
    serve.run(app_with_pools(config, FaultyPool), name=ROUTER_APP, route_prefix=ROUTER_PREFIX)
    url = f"{api_server.url}{ROUTER_PREFIX}"
    wait_healthy(f"{url}/health", 300)
    yield RouterServer(url, config)
    delete_app(ROUTER_APP)


@pytest.fixture(scope="module", name="server")
def router_server_without_faults(router_server):
    """The router app, with every fault switched off when the module's tests are done (even after a
    failure), so the next module starts from healthy pools."""
    yield router_server
    for pool in ("coding", "reasoning", "chat"):
        router_server.set_fault(pool, None)


def app_with_pools(config, pool_class):
    """The app `build_app` makes, with a test subclass of `ModelPool` serving every pool (shipped to
    the replicas by value: they cannot import tests/)."""
    import sys

    import ray
    from ray import serve

    from raylane.deployments.app import gateway_deployment_options, pool_deployment_options
    from raylane.deployments.gateway.ingress import Gateway

    ray.cloudpickle.register_pickle_by_value(sys.modules[pool_class.__module__])
    pools = {p.name: serve.deployment(pool_class, **pool_deployment_options(p)).bind(p) for p in config.pools}
    return serve.deployment(Gateway, **gateway_deployment_options(config)).bind(config, pools)


def wait_until(predicate, timeout_s: float, what: str, period_s: float = 0.25):
    """The predicate's first true value, polled; TimeoutError naming `what` if none comes in time."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s")
        time.sleep(period_s)


def wait_healthy(url: str, timeout_s: float) -> None:
    apps.wait_healthy(url, time.monotonic() + timeout_s)


def descendants(*pids: int) -> set[int]:
    """Every process below `pids` (children, theirs, ...), from one read of /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), list(pids)
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def stop_processes_mentioning(marker: str, grace_s: float = 3.0) -> None:
    """Kill the processes whose command line names `marker` (this cluster's temp dir), and every
    process below them: SIGTERM, then SIGKILL to what is left after `grace_s` (a test's throwaway
    cluster: nothing in it to save, and some of its processes outlived 10 s of SIGTERM every time).
    The processes below are found before any is signalled: Ray's dashboard agent renames itself
    (`ray::DashboardAgent`, no marker), and once its raylet was gone it spun on a whole core for a
    minute, slowing the next test's cluster start by half (seen on a test after the k8s module)."""

    def matching() -> set[int]:
        pids = set()
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and marker.encode() in (proc / "cmdline").read_bytes():
                    pids.add(int(proc.name))
            except OSError:
                continue
        return pids

    found = matching()
    tree = found | descendants(*found)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in tree | matching():
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while any(map(alive, tree | matching())) and time.monotonic() < deadline:
            time.sleep(0.2)


def alive(pid: int) -> bool:
    """Running, not a zombie; False for a process that is gone, even one going as this reads it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
