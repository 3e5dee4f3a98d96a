"""What the ops jobs share: the endpoint, the API key, the deployed config and small HTTP calls."""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000"


def add_endpoint_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        default=os.environ.get("RAYLANE_URL", DEFAULT_URL),
        help=f"the API root (default $RAYLANE_URL or {DEFAULT_URL}: this node's Serve proxy)",
    )
    parser.add_argument(
        "--api-key", default=os.environ.get("RAYLANE_API_KEY", "none"), help="default: $RAYLANE_API_KEY"
    )
    parser.add_argument("--config", help="cluster config YAML (default: the one Serve deployed)")
    parser.add_argument("--app", default="raylane", help="Serve application name (default raylane)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request")


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: Any  # parsed JSON, or text

    @property
    def error(self) -> str:
        if isinstance(self.body, dict) and isinstance(self.body.get("error"), dict):
            return self.body["error"].get("message", "")
        return str(self.body)[:300]


def call(args, method: str, path: str, body: dict | None = None) -> Response:
    """One request; network errors come back as status 0 rather than raising."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(args.url.rstrip("/") + path, data=data, method=method)
    request.add_header("Authorization", f"Bearer {args.api_key}")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as r:
            status, headers, raw = r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        status, headers, raw = e.code, dict(e.headers), e.read()
    except (OSError, urllib.error.URLError) as e:
        return Response(0, {}, f"{type(e).__name__}: {e}")
    headers = {k.lower(): v for k, v in headers.items()}
    try:
        return Response(status, headers, json.loads(raw))
    except ValueError:
        return Response(status, headers, raw.decode(errors="replace"))


def chat(args, model: str, messages: list[dict], max_tokens: int = 4) -> Response:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return call(args, "POST", "/v1/chat/completions", body)


def connect_ray() -> bool:
    """Join the cluster the job runs on (a job driver has RAY_ADDRESS); False outside one."""
    import ray

    if ray.is_initialized():
        return True
    if not os.environ.get("RAY_ADDRESS"):
        return False
    ray.init(address="auto", log_to_driver=False, configure_logging=False)
    return True


def serve_details(app: str) -> dict | None:
    """Serve's view of the application (status, deployments, replicas, deployed config), or None."""
    if not connect_ray():
        return None
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return None
    return client.get_serve_details().get("applications", {}).get(app)


def load_config(args, details: dict | None = None):
    """`--config`, else the config Serve deployed (the builder's `args`), else None."""
    from raylane.config import ClusterConfig

    if args.config:
        return ClusterConfig.from_yaml(args.config)
    details = details if details is not None else serve_details(args.app)
    deployed = (details or {}).get("deployed_app_config") or {}
    app_args = deployed.get("args")
    if not app_args:
        return None
    if set(app_args) == {"config_path"}:
        return ClusterConfig.from_yaml(app_args["config_path"])
    config = ClusterConfig.from_dict(app_args, source="the deployed application's args")
    # A manifest's gateway sections travel as the Gateway's user config (cluster/k8s.py).
    gateway = [d for d in deployed.get("deployments", []) if d.get("name") == "Gateway"]
    sections = (gateway[0].get("user_config") or {}).get("sections") if gateway else None
    return config.with_sections(sections, "the Gateway's user_config") if sections else config
