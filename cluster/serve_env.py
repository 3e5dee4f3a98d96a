"""The Ray Serve settings raylane runs with: environment variables, read by every Ray process.

On two CPU cores a streamed token costs about as much CPU in Serve's machinery (the proxy, the
gateway and the pool replica each pass every chunk on) as the engine step that made it, so these
settings, all Ray Serve's own (the documented parts of its `RAY_SERVE_THROUGHPUT_OPTIMIZED` mode),
decide much of the serving overhead (`raylane bench overhead`, bench/README.md):

- user code and the handle router run on the replica's own event loop: no hop between threads,
  and two threads fewer competing with the engine thread for the GIL;
- the proxy and deployment handles talk gRPC, not Ray actor calls.

Direct ingress, the rest of that mode, is `http.ingress: haproxy`: an HAProxy per node forwards
connections to the gateway replicas, which serve HTTP themselves, so the proxy actor leaves the path.
Ray 2.60's HAProxy keeps its files under /tmp/haproxy-serve and listens on fixed stats, metrics and
fallback-proxy ports, the same for every cluster; `haproxy_env` gives each Ray started here its own,
so two such clusters on one machine stay out of each other's way. It is not the default: HAProxy
(2.8, `option abortonclose`) only drops requests not yet sent to a replica when their client closes,
so a client that leaves while waiting for a whole (non-streamed) response no longer stops its
generation; through the proxy it stops at once.

The variables must be in the environment of Ray's processes: `raylane serve` and the benchmarks
start Ray inside `serve_env()`, the KubeRay manifests set them in every Ray container. The process
that starts Ray keeps Serve's defaults, since a driver calls handles outside an event loop, which a
handle router on the caller's loop cannot serve. A variable already set wins.
"""

import contextlib
import glob
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager

SERVE_ENV = {
    # Serve's proxy (uvicorn) takes a client's address from X-Forwarded-For when the peer is local,
    # and HAProxy on the same node, or any local process, is one: open mode keys its callers by
    # address, so a client could name a new one per request. No peer is trusted to set it.
    "FORWARDED_ALLOW_IPS": "",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
}

HAPROXY_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    # An ingress replica that stops keeps serving this long so that load balancers in front of it
    # notice; Serve's default (30 s) is for external ones. Serve reloads its own HAProxy within a
    # fraction of a second, and `raylane serve` drains the gateway before it stops anything.
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "5",
}
# Ray 2.60's HAProxy defaults are the same for every cluster: its files under /tmp/haproxy-serve,
# stats, metrics and fallback-proxy ports 8404, 9101, 8500 and 9500. Each Ray raylane starts gets
# its own (`haproxy_env`), so a test session, a `raylane serve` and a benchmark can run side by side.
HAPROXY_PORTS = {
    "RAY_SERVE_HAPROXY_STATS_PORT": "stats",
    "RAY_SERVE_HAPROXY_METRICS_PORT": "metrics",
    "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": "fallback proxy HTTP",
    "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": "fallback proxy gRPC",
}
HAPROXY_FILES = {
    "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": "haproxy.cfg",
    "RAY_SERVE_HAPROXY_SOCKET_PATH": "admin.sock",
    "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": "metrics.sock",
    "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": "server-state",
}
# HAProxy puts each node's files in a subfolder named by the node id (56 characters) and allows
# socket paths of at most 97: the folder has to be short, in /tmp whatever $TMPDIR says.
STATE_ROOT, STATE_PREFIX = "/tmp", "rlha-"


def haproxy_problem() -> str | None:
    """Why `http.ingress: haproxy` cannot run here, or None. Serve would only retry HAProxy forever."""
    if not sys.platform.startswith("linux"):
        return "Serve's HAProxy ingress runs on Linux only"
    try:
        # Serve's own lookup (RAY_SERVE_HAPROXY_BINARY_PATH, the bundled binary, then PATH), without
        # the log line its public twin writes on every call.
        from ray.serve._private.haproxy import _resolve_haproxy_binary

        _resolve_haproxy_binary()
    except (ImportError, FileNotFoundError) as e:
        return f"no HAProxy binary ({e})"
    for name, use in HAPROXY_PORTS.items():  # ports set by hand: the ones raylane picks are free
        if name in os.environ and (why := port_problem("0.0.0.0", int(os.environ[name]))):
            return f"port {os.environ[name]} ({name}), where HAProxy serves its {use}: {why}"
    return None


def running_ingress(serve_details: dict) -> str:
    """haproxy when Serve runs HAProxy (its proxy actors are then HAProxy managers), else proxy."""
    import ray

    for proxy in (serve_details.get("proxies") or {}).values():
        actor = ray.get_actor(proxy["actor_name"], namespace="serve")
        haproxy = actor._ray_actor_creation_function_descriptor.class_name == "HAProxyManager"
        return "haproxy" if haproxy else "proxy"
    return "proxy"


def haproxy_env() -> dict[str, str]:
    """HAPROXY_ENV plus files and ports of this cluster's own (a variable already set wins)."""
    _remove_stale_state()
    state = tempfile.mkdtemp(prefix=STATE_PREFIX, dir=STATE_ROOT)
    files = {name: os.path.join(state, file) for name, file in HAPROXY_FILES.items()}
    return (
        HAPROXY_ENV
        | files
        | {"RAY_SERVE_HAPROXY_SERVER_STATE_BASE": state}
        | {name: str(port) for name, port in zip(HAPROXY_PORTS, free_ports(len(HAPROXY_PORTS)), strict=True)}
    )


def free_port() -> int:
    """A TCP port free on every interface (so on the loopback too)."""
    return free_ports(1)[0]


def free_ports(count: int, taken: Collection[int] = ()) -> list[int]:
    """`count` different free ports, none in `taken` (picked earlier, not yet listened on): each is
    held while the next is picked (a port just let go can be the kernel's next pick: a test's two
    picks in a row once got the same port)."""
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        while len(ports) < count:
            s = stack.enter_context(socket.socket())
            s.bind(("0.0.0.0", 0))
            if s.getsockname()[1] not in taken:
                ports.append(s.getsockname()[1])
        return ports


def port_problem(host: str, port: int) -> str | None:
    """Why a listener could not bind `host:port`, found before starting anything (Serve would only
    retry), or None."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        return e.strerror or str(e)
    return None


def _remove_stale_state(min_age_s: float = 600.0) -> None:
    """Drop the folders of HAProxies that are gone: nothing listens on an admin socket in them (each
    node's HAProxy keeps its own in a subfolder)."""
    for state in glob.glob(os.path.join(STATE_ROOT, STATE_PREFIX + "*")):
        with contextlib.suppress(OSError):
            if time.time() - os.path.getmtime(state) < min_age_s:  # perhaps a Ray starting right now
                continue
        sockets = glob.glob(
            os.path.join(state, "**", HAPROXY_FILES["RAY_SERVE_HAPROXY_SOCKET_PATH"]), recursive=True
        )
        if not any(_listening(path) for path in sockets):
            shutil.rmtree(state, ignore_errors=True)


def _listening(unix_socket: str) -> bool:
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(unix_socket)
        except OSError:
            return False
    return True


@contextmanager
def serve_env(ingress: str = "proxy") -> Iterator[None]:
    """Start Ray inside this: the processes it starts inherit raylane's Serve settings."""
    import ray.serve._private.constants  # noqa: F401  (read now: this process keeps the defaults)

    settings = SERVE_ENV | (haproxy_env() if ingress == "haproxy" else {})
    added = {name: value for name, value in settings.items() if name not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)
