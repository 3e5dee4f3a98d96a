"""The Ray Serve settings raylane runs with: environment variables, read by every Ray process.

On two CPU cores a streamed token costs about as much CPU in Serve's machinery (the proxy, the
gateway and the pool replica each pass every chunk on) as the engine step that made it, so these
settings, all Ray Serve's own (the documented parts of its `RAY_SERVE_THROUGHPUT_OPTIMIZED` mode),
decide much of the serving overhead (`raylane bench overhead`, bench/README.md):

- user code and the handle router run on the replica's own event loop: no hop between threads,
  and two threads fewer competing with the engine thread for the GIL;
- the proxy and deployment handles talk gRPC, not Ray actor calls.

Left out of that mode on purpose: direct ingress (each gateway replica on a port of its own, for an
HAProxy in front; an ingress replica then drains for at least 30 s), and the frozen garbage
collector. The variables must be in the environment of Ray's processes: `raylane serve` and the
benchmarks start Ray inside `serve_env()`, the KubeRay manifests set them in every Ray container.
The process that starts Ray keeps Serve's defaults, since a driver calls handles outside an event
loop, which a handle router on the caller's loop cannot serve. A variable already set wins.
"""

import os
from collections.abc import Iterator
from contextlib import contextmanager

SERVE_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
}


@contextmanager
def serve_env() -> Iterator[None]:
    """Start Ray inside this: the processes it starts inherit raylane's Serve settings."""
    import ray.serve._private.constants  # noqa: F401  (read now: this process keeps the defaults)

    added = {name: value for name, value in SERVE_ENV.items() if name not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)
