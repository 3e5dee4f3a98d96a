"""raylane apps that a benchmark starts itself: one in-process Ray + Serve, each `ClusterConfig` deployed
as its own Serve application under its own route prefix (/a, /b, ...) on one HTTP port.

    with LocalServe() as local:
        urls = local.deploy({"a": config_a, "b": config_b})  # {"a": "http://127.0.0.1:PORT/a", ...}
        ...                                                  # the OpenAI API at urls["a"] + "/v1"

Both configs' apps run side by side, so a comparison can alternate between them request by request.
Apps staged with `add` are deployed together at the first `url` call, so their replicas load in
parallel. Each config's `http` section is not used: one Serve has one HTTP listener. On exit the apps
this object deployed are deleted; Serve and Ray are shut down only if this object started them, so a
Ray (and Serve apps) already running, a test session's for instance, are left as they were.
"""

import os
import sys
import time
from types import TracebackType

from raylane.cluster.serve_env import free_port
from raylane.config import ClusterConfig

APP_PREFIX = "raylane-bench-"
DEPLOY_TIMEOUT_S = 600.0  # loading checkpoints and the router's classifier on two busy cores
# Logical CPUs of a Ray this module starts. The apps' replicas idle between requests, so the count
# only has to let every replica be placed; the real contention for the cores is what a benchmark
# measures (and prints, as other load).
LOGICAL_CPUS = 16


class LocalServeError(RuntimeError):
    pass


def prepare_checkpoints(configs: list[ClusterConfig]) -> None:
    """Write demo checkpoints here once (replicas would each write them) and fail early, naming the
    pool, when a checkpoint directory is missing (Serve would only retry the replica)."""
    from raylane.models.demo import create_demo_models, default_demo_dir
    from raylane.models.sources import missing_checkpoints

    demo = sorted({p.demo_model for c in configs for p in c.pools if p.demo_model})
    if demo:
        create_demo_models(default_demo_dir(), names=demo)
    missing = [problem for c in configs for problem in missing_checkpoints(c)]
    if missing:
        raise LocalServeError("; ".join(missing))


class LocalServe:
    """In-process Ray + Serve for benchmark apps (see the module docstring)."""

    def __init__(self, deploy_timeout_s: float = DEPLOY_TIMEOUT_S, ingress: str = "proxy"):
        self.deploy_timeout_s = deploy_timeout_s
        self.ingress = ingress  # asked for; once entered, what runs in front of the apps
        self.port: int | None = None
        self.apps: list[str] = []  # the Serve apps this object deployed (deleted on exit)
        self._pending: dict[str, ClusterConfig] = {}
        self._pending_apps: dict[str, object] = {}  # name -> a bound Serve application (not raylane's)
        self._urls: dict[str, str] = {}
        self._started_ray = False
        self._started_serve = False

    def __enter__(self) -> "LocalServe":
        import ray
        from ray import serve
        from ray.serve.context import _get_global_client

        from raylane.cluster.serve_env import running_ingress, serve_env

        if why := self.ingress_problem(self.ingress):
            raise LocalServeError(f"--ingress {self.ingress}: {why}")
        joined = os.environ.get("RAY_ADDRESS")
        if not ray.is_initialized():
            with serve_env(self.ingress):
                ray.init(
                    address=joined or "local",
                    num_cpus=None if joined else max(os.cpu_count() or 1, LOGICAL_CPUS),
                    include_dashboard=False,
                    log_to_driver=False,
                    configure_logging=False,
                )
            self._started_ray = True
        client = _get_global_client(raise_if_no_controller_running=False)
        if client is not None:  # Serve already runs (a test session, a cluster): use its listener
            details = client.get_serve_details()
            self.port = int((details.get("http_options") or {}).get("port") or 8000)
            self.ingress = running_ingress(details)
        else:
            self.port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": self.port})
            self._started_serve = True
        return self

    @staticmethod
    def ingress_problem(ingress: str) -> str | None:
        """Why a LocalServe cannot serve behind `ingress` here, or None: the ingress is fixed when Ray
        starts, so HAProxy needs a Ray this object starts itself."""
        import ray

        from raylane.cluster.serve_env import haproxy_problem

        if ingress == "proxy":
            return None
        if ray.is_initialized() or os.environ.get("RAY_ADDRESS"):
            return "it needs a Ray started here, not one already running"
        return haproxy_problem()

    def add(self, name: str, config: ClusterConfig) -> None:
        """Stage `config` as app `raylane-bench-NAME` at /NAME; the next `url` or `deploy` starts it."""
        self._check_free(name)
        self._pending[name] = config

    def add_app(self, name: str, app) -> None:
        """Stage a bound Serve application (one that answers GET /health) as app `raylane-bench-NAME`."""
        self._check_free(name)
        self._pending_apps[name] = app

    def _check_free(self, name: str) -> None:
        if name in self._urls or name in self._pending or name in self._pending_apps:
            raise LocalServeError(f"an app named {name!r} is already there")

    def url(self, name: str) -> str:
        """The app's root URL, once it answers /health (deploying every staged app first, at once)."""
        if self._pending or self._pending_apps:
            self._deploy_pending()
        return self._urls[name]

    def deploy(self, configs: dict[str, ClusterConfig]) -> dict[str, str]:
        """Deploy each config at /NAME, all at once; NAME -> the app's root URL once all are healthy."""
        for name, config in configs.items():
            self.add(name, config)
        return {name: self.url(name) for name in configs}

    def _deploy_pending(self) -> None:
        from ray import serve
        from ray.serve.api import RunTarget

        from raylane.deployments.app import build_app

        configs, self._pending = self._pending, {}
        prepare_checkpoints(list(configs.values()))
        pending = {name: build_app(config) for name, config in configs.items()} | self._pending_apps
        self._pending_apps = {}
        targets = [
            RunTarget(app, name=APP_PREFIX + name, route_prefix=f"/{name}") for name, app in pending.items()
        ]
        self.apps += [t.name for t in targets]  # deleted on exit even if deploying fails halfway
        print(f"deploying {', '.join(t.name for t in targets)} on port {self.port} ...", file=sys.stderr)
        serve.run_many(targets)  # returns once every app's replicas run
        deadline = time.monotonic() + self.deploy_timeout_s
        for name in pending:
            url = f"http://127.0.0.1:{self.port}/{name}"
            wait_healthy(f"{url}/health", deadline)
            self._urls[name] = url

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        import ray
        from ray import serve

        from raylane.deployments.app import delete_app

        try:
            delete_app(*self.apps)
            if self._started_serve:
                serve.shutdown()
        finally:
            if self._started_ray:
                ray.shutdown()


def wait_healthy(url: str, deadline: float) -> None:
    """Poll `url` until it answers 200 (the gateway answers 503 while a pool is still loading)."""
    import httpx2

    last = "no answer"
    while True:
        try:
            response = httpx2.get(url, timeout=30)
            if response.status_code == 200:
                return
            last = f"{response.status_code} {response.text[:200]}"
        except httpx2.HTTPError as e:
            last = repr(e)
        if time.monotonic() > deadline:
            raise LocalServeError(f"{url} did not become healthy: {last}")
        time.sleep(0.5)
