"""`raylane serve`: run the OpenAI-compatible API in the foreground, like `serve run`.

Starts a local Ray (or joins the cluster at $RAY_ADDRESS), deploys the Serve app built from the
config (the embedded default when none is given: the demo models as the coding, reasoning and chat
pools), prints the URL and waits. Ctrl-C or SIGTERM drains the app (new requests get 503 with
Retry-After while those in flight finish, up to gateway.drain_timeout_s), deletes it, shuts Serve
down and stops the Ray it started, so nothing is left running.

SIGHUP reads the config file again and applies it in place (`raylane apply`, cluster/apply.py:
only what changed restarts, a pool at a time, a replica at a time).

Against a cluster that already runs the app (RAY_ADDRESS, or a local Ray already serving on the
port) it applies the new config the same way and returns. An app whose config was not recorded
(deployed from a Serve config file's `import_path`) is redeployed whole: Serve restarts every
deployment, each old replica stopping once its replacement runs and finishing its in-flight
requests and streams first (up to `raylane.deployments.app.GRACEFUL_SHUTDOWN_TIMEOUT_S`).
"""

import argparse
import logging
import os
import signal
import sys
import threading


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="cluster config YAML (default: the embedded demo config)")
    parser.add_argument("--host", help="listen address (default: the config's http.host)")
    parser.add_argument("--port", type=int, help="listen port (default: the config's http.port)")
    parser.add_argument(
        "--access-log",
        action="store_true",
        help="show Serve's access line for every call, health polls included (logs.serve_access_log)",
    )


def load_config(args: argparse.Namespace):
    from pydantic import ValidationError

    from raylane.config import ClusterConfig, ConfigError, HttpConfig, default_config, format_errors

    config = ClusterConfig.from_yaml(args.config) if args.config else default_config()
    if getattr(args, "access_log", False):
        config = config.model_copy(update={"logs": config.logs.model_copy(update={"serve_access_log": True})})
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    if not overrides:
        return config
    data = config.http.model_dump() | overrides
    try:
        http = HttpConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_errors(e, data, "--host/--port")) from None
    return config.model_copy(update={"http": http})


def run(args: argparse.Namespace) -> int:
    from raylane.config import ConfigError

    try:
        config = load_config(args)
    except ConfigError as e:
        print(f"raylane serve: {e}", file=sys.stderr)
        return 2
    from raylane.cluster.serve_env import port_problem

    joined = bool(os.environ.get("RAY_ADDRESS"))
    problem = None if joined else port_problem(config.http.host, config.http.port)
    if joined or problem:  # perhaps our own app is already there: update it in place
        status = redeploy_in_place(config)
        if status is not None:
            return status
    if problem:
        print(
            f"raylane serve: cannot listen on {config.http.host}:{config.http.port}: {problem}",
            file=sys.stderr,
        )
        return 2
    from raylane.models.sources import missing_checkpoints

    if not joined and (missing := missing_checkpoints(config)):  # on this machine, check before starting
        print("raylane serve: " + "; ".join(missing), file=sys.stderr)
        return 2
    if not joined and config.http.ingress == "haproxy":
        from raylane.cluster.serve_env import haproxy_problem

        if why := haproxy_problem():
            print(f"raylane serve: http.ingress: haproxy: {why}; use proxy", file=sys.stderr)
            return 2
    demo = sorted({p.demo_model for p in config.pools if p.demo_model})
    if demo:  # write them here, with a progress bar, rather than silently in each replica
        from raylane.models.demo import create_demo_models, default_demo_dir

        create_demo_models(default_demo_dir(), names=demo)
    prepare_gguf_sidecars(config)

    import ray
    from ray import serve

    from raylane.cluster.apply import deploy_live
    from raylane.cluster.local_head import LocalHead
    from raylane.cluster.serve_env import serve_env
    from raylane.deployments.app import APP_NAME

    status, head = 0, None
    # This process's Serve client logs each step at INFO too ("Started Serve", "Application ... is ready"
    # before raylane's own ready line): the same level as the controller's.
    logging.getLogger("ray.serve").setLevel(config.logs.serve_log_level)
    print("raylane: starting Ray", flush=True)
    for signum in (signal.SIGINT, signal.SIGTERM):  # SIGINT too: a shell may start us with it ignored
        _stop_on(signum)
    try:
        # A cluster joined runs what it was started with. A local one is a head in a session of its
        # own (cluster/local_head.py), so a stop sent to our whole process group reaches only us.
        with serve_env(config.http.ingress):
            head = None if joined else LocalHead.start()
        address = os.environ["RAY_ADDRESS"] if joined else head.address
        context = ray.init(address=address, namespace="raylane", logging_level="WARNING")
        for signum in (signal.SIGINT, signal.SIGTERM):  # again: the driver's core worker installs its own
            _stop_on(signum)
        http = config.http
        http_options = {"host": http.host, "port": http.port}
        if http.request_timeout_s is not None:
            http_options["request_timeout_s"] = http.request_timeout_s
        serve.start(http_options=http_options, logging_config=serve_logging_config(config))
        pools = ", ".join(p.name for p in config.pools)
        print(f"raylane: starting the gateway and the pools ({pools}); the models load", flush=True)
        deploy_live(config, APP_NAME)  # returns once every replica is up
        host = "127.0.0.1" if http.host in ("0.0.0.0", "::") else http.host
        models = ", ".join(p.model_id for p in config.pools)
        front = "" if joined else f", behind Serve's {'HAProxy' if http.ingress == 'haproxy' else 'proxy'}"
        print(
            f"raylane: OpenAI API at http://{host}:{http.port}/v1 (models: {models}{front}); Ctrl-C stops it",
            flush=True,
        )
        dashboard = f"; Ray's dashboard at http://{context.dashboard_url}" if context.dashboard_url else ""
        print(
            f"raylane: health at http://{host}:{http.port}/health, metrics at /metrics{dashboard}; "
            "the docs: docs/index.md (`mkdocs serve` in a checkout), `raylane status` for the pools",
            flush=True,
        )
        reload = threading.Event()
        signal.signal(signal.SIGHUP, lambda *_: reload.set())
        while True:
            if reload.wait(3600):
                reload.clear()
                _reapply(args)
    except KeyboardInterrupt:
        print("raylane: shutting down", flush=True)
    except Exception as e:  # a deployment that failed (replicas could not start): say so, clean up
        print(f"raylane serve: {e}", file=sys.stderr, flush=True)
        status = 1
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the clean-up short
            signal.signal(signum, signal.SIG_IGN)
        if ray.is_initialized():
            _drain(config.gateway.drain_timeout_s)
            _shutdown(serve, joined)
            ray.shutdown()
        if head is not None:
            head.stop()
        print("raylane: stopped", flush=True)
    return status


def _reapply(args: argparse.Namespace) -> None:
    """SIGHUP: read the config file again and apply it to the running app (`raylane apply`)."""
    from raylane.cluster.apply import ApplyError, apply_config
    from raylane.config import ConfigError
    from raylane.deployments.app import APP_NAME

    if not args.config:
        print("raylane: SIGHUP: started without --config, nothing to read again", flush=True)
        return
    print(f"raylane: SIGHUP: applying {args.config}", flush=True)
    try:
        apply_config(load_config(args), APP_NAME, log=lambda line: print(line, flush=True))
    except (ConfigError, ApplyError) as e:
        print(f"raylane: the new config was not applied: {e}", file=sys.stderr, flush=True)


def serve_logging_config(config) -> dict:
    """Serve's controller and proxies log each deployment step at INFO; a newcomer's screen wants the
    start-up progress, the ready line and errors (`logs.serve_log_level`, WARNING by default). Serve's
    per-call access lines are off unless `logs.serve_access_log` (the gateway and pools set theirs in
    deployments/app.py)."""
    return {"log_level": config.logs.serve_log_level, "enable_access_log": config.logs.serve_access_log}


def redeploy_in_place(config) -> int | None:
    """Deploy `config` over the running app and return the exit status; None when no Ray cluster
    or no raylane app is running there (then this command starts one as usual)."""
    import ray
    from ray import serve
    from ray.serve.context import _get_global_client

    from raylane.cluster.apply import apply_config
    from raylane.cluster.serve_env import running_ingress
    from raylane.deployments import live_config
    from raylane.deployments.app import APP_NAME, build_app

    try:
        ray.init(address=os.environ.get("RAY_ADDRESS") or "auto", namespace="raylane", log_to_driver=False)
    except ConnectionError:
        return None
    try:
        client = _get_global_client(raise_if_no_controller_running=False)
        details = client.get_serve_details() if client is not None else {}
        if APP_NAME not in details.get("applications", {}):
            return None
        running = details.get("http_options") or {}
        if running.get("port") != config.http.port:
            print(
                f"raylane serve: http.port {config.http.port} differs from the running cluster's "
                f"{running.get('port')}; the HTTP listener cannot move in place: stop it first",
                file=sys.stderr,
            )
            return 2
        if config.http.ingress != (ingress := running_ingress(details)):
            print(
                f"raylane serve: http.ingress {config.http.ingress} differs from the running cluster's "
                f"{ingress}; the ingress is fixed when Ray starts: stop it first",
                file=sys.stderr,
            )
            return 2
        if live_config.read_state(APP_NAME) is not None:  # recorded by `raylane serve`: only the difference
            apply_config(config, APP_NAME)
            return 0
        print(f"raylane: redeploying {APP_NAME} in place; requests in flight finish on the old replicas")
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        models = ", ".join(p.model_id for p in config.pools)
        print(f"raylane: redeployed (models: {models}); the serving process keeps running", flush=True)
        return 0
    except Exception as e:  # the new config's replicas could not start: Serve keeps what it can
        print(f"raylane serve: redeploy failed: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        ray.shutdown()


def prepare_gguf_sidecars(config) -> None:
    """A GGUF pool's tokenizer and config are converted once per machine (models/gguf.py): do it here,
    saying so, rather than in each replica at once."""
    from raylane.models.gguf import gguf_sidecar, is_gguf
    from raylane.models.sources import model_path

    for path in dict.fromkeys(model_path(p) for p in config.pools if p.demo_model is None):
        if is_gguf(path):
            name = os.path.basename(path)
            print(f"raylane serve: reading {name} (its tokenizer is converted once)", flush=True)
            gguf_sidecar(path)


def _stop_on(signum: int) -> None:
    def handler(*_):
        raise KeyboardInterrupt

    signal.signal(signum, handler)


def _drain(timeout_s: float) -> None:
    """New requests get 503 + Retry-After while those in flight finish (up to `timeout_s`)."""
    from raylane.deployments.app import APP_NAME
    from raylane.deployments.gateway.drain import drain_app

    def waiting(busy: dict[str, int]) -> None:
        in_flight = sum(busy.values())
        print(f"raylane: draining: {in_flight} requests in flight (up to {timeout_s:g} s)", flush=True)

    try:
        left = drain_app(APP_NAME, timeout_s, on_wait=waiting)
    except Exception as e:  # the app never came up, or Ray is going down: nothing to drain
        print(f"raylane: drain: {e!r}", file=sys.stderr)
        return
    if any(left.values()):
        print(f"raylane: drain timed out; cutting {sum(left.values())} requests", flush=True)


def _shutdown(serve, joined: bool) -> None:
    from raylane.deployments.app import APP_NAME, delete_app

    try:
        if joined:  # leave other apps on a shared cluster alone
            delete_app(APP_NAME)  # (the batch records stay on disk, for the next `raylane serve`)
            if serve.status().applications:
                return
        serve.shutdown()
    except Exception as e:  # Ray going down anyway: report, do not mask the exit
        print(f"raylane: Serve shutdown: {e!r}", file=sys.stderr)
