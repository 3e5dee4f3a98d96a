"""The Ray Serve settings raylane runs with: environment variables, read by every Ray process.

On two CPU cores a streamed token costs about as much CPU in Serve's machinery (the proxy, the
gateway and the pool replica each pass every chunk on) as the engine step that made it, so these
settings, all Ray Serve's own (the documented parts of its `RAY_SERVE_THROUGHPUT_OPTIMIZED` mode),
decide much of the serving overhead (`raylane bench overhead`, bench/README.md):

- user code and the handle router run on the replica's own event loop: no hop between threads,
  and two threads fewer competing with the engine thread for the GIL;
- the proxy and deployment handles talk gRPC, not Ray actor calls.

Direct ingress, the rest of that mode, is `http.ingress: haproxy` (`HAPROXY_ENV`): an HAProxy per
node forwards connections to the gateway replicas, which serve HTTP themselves, so the proxy actor
leaves the path. It is not the default: Ray 2.60's HAProxy keeps its config and admin socket under
/tmp/haproxy-serve and listens on fixed stats and metrics ports (8404, 9101, on all interfaces), so
two Ray clusters on one machine (a test session and a `raylane serve`) get in each other's way.

The variables must be in the environment of Ray's processes: `raylane serve` and the benchmarks
start Ray inside `serve_env()`, the KubeRay manifests set them in every Ray container. The process
that starts Ray keeps Serve's defaults, since a driver calls handles outside an event loop, which a
handle router on the caller's loop cannot serve. A variable already set wins.
"""

import os
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager

SERVE_ENV = {
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


def haproxy_problem() -> str | None:
    """Why `http.ingress: haproxy` cannot run here, or None. Serve would only retry HAProxy forever."""
    if not sys.platform.startswith("linux"):
        return "Serve's HAProxy ingress runs on Linux only"
    try:
        from ray.serve._private import constants
        from ray.serve._private.haproxy import get_haproxy_binary

        get_haproxy_binary()
    except (ImportError, FileNotFoundError) as e:
        return f"no HAProxy binary ({e})"
    for port, use in (
        (constants.RAY_SERVE_HAPROXY_STATS_PORT, "stats"),
        (constants.RAY_SERVE_HAPROXY_METRICS_PORT, "metrics"),
    ):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                return (
                    f"port {port}, where HAProxy serves its {use}, is taken (another Ray with this ingress "
                    "on the machine, or an HAProxy left by a killed one)"
                )
    return None


@contextmanager
def serve_env(ingress: str = "proxy") -> Iterator[None]:
    """Start Ray inside this: the processes it starts inherit raylane's Serve settings."""
    import ray.serve._private.constants  # noqa: F401  (read now: this process keeps the defaults)

    settings = SERVE_ENV | (HAPROXY_ENV if ingress == "haproxy" else {})
    added = {name: value for name, value in settings.items() if name not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)
