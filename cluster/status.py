"""`raylane status`: the live cluster's pools, replicas and load, as a terminal table.

Replica counts and health come from Ray Serve (`serve.status()`); load from the app's metrics
aggregator (deployments/metrics/aggregator.py): requests running and waiting and KV-cache use per replica
(as each replica last reported, about a second ago), tokens/s and the error rate over the last
minute or so.

    raylane status                     # the cluster at $RAY_ADDRESS, or the local one
    raylane status --address ray://head:10001
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field

POOL_PREFIX = "ModelPool:"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address", default=None, help="Ray cluster address (default: $RAY_ADDRESS, else the local cluster)"
    )
    parser.add_argument("--app", default="raylane", help="Serve application name (default: raylane)")


@dataclass
class ReplicaRow:
    replica: str
    running: float = 0.0
    waiting: float = 0.0
    kv: float | None = None


@dataclass
class PoolRow:
    name: str  # pool name, or the deployment's for the gateway
    model: str = ""
    status: str = "?"
    replicas_running: int = 0
    replicas_total: int = 0
    replicas: list[ReplicaRow] = field(default_factory=list)
    tokens_per_s: float | None = None
    error_rate: float | None = None  # finished with an engine error / finished, recently

    @property
    def running(self) -> float:
        return sum(r.running for r in self.replicas)

    @property
    def waiting(self) -> float:
        return sum(r.waiting for r in self.replicas)

    @property
    def kv(self) -> float | None:
        values = [r.kv for r in self.replicas if r.kv is not None]
        return sum(values) / len(values) if values else None


def collect(app_name: str = "raylane") -> tuple[list[PoolRow], dict]:
    """Rows for every deployment of the app, and app-wide figures (`http_error_rate`, `message`)."""
    from ray import serve

    app = serve.status().applications.get(app_name)
    if app is None:
        raise LookupError(f"no Serve application {app_name!r} is running on this cluster")
    rows = []
    for name, dep in app.deployments.items():
        states = {str(getattr(k, "value", k)): v for k, v in dep.replica_states.items()}
        rows.append(
            PoolRow(
                name=name.removeprefix(POOL_PREFIX),
                status=str(getattr(dep.status, "value", dep.status)),
                replicas_running=states.get("RUNNING", 0),
                replicas_total=sum(states.values()),
            )
        )
    snapshot = _snapshot(app_name)
    app_wide = {"status": str(getattr(app.status, "value", app.status)), "http_error_rate": None}
    if snapshot is not None:
        _add_load(rows, snapshot, app_wide)
    else:
        app_wide["message"] = "no metrics yet (the app has not reported since it started)"
    rows.sort(key=lambda r: (r.name == "Gateway", r.name))
    _add_live_config(app_name, rows, app_wide)
    app_wide["batches"], app_wide["batch_runner"] = _batches(app_name)
    return rows, app_wide


def _batches(app_name: str) -> tuple[list[dict], dict]:
    """The app's batches not yet ended, with their progress, and the state of the runner sending
    their lines (none when it never ran a batch)."""
    import ray

    from raylane.deployments.batch.service import service_name
    from raylane.deployments.detached import NAMESPACE

    try:
        actor = ray.get_actor(service_name(app_name), namespace=NAMESPACE)
        return tuple(ray.get([actor.active_batches.remote(), actor.runner_state.remote()], timeout=30))
    except (ValueError, ray.exceptions.RayError):
        return [], {}


def _add_live_config(app_name: str, rows: list[PoolRow], app_wide: dict) -> None:
    """The config generation served and, during `raylane apply`, what it is doing to which pool."""
    from raylane.deployments import live_config

    state = live_config.read_state(app_name)
    if state is None:
        return
    app_wide["config_generation"] = state.generation
    if state.apply is not None:
        app_wide["apply"] = f"to generation {state.apply['generation']}: {state.apply['step']}"
        for row in rows:
            if (action := state.apply["pools"].get(row.name)) is not None:
                row.status += f" ({action}: {row.replicas_running} running of {row.replicas_total})"


def _snapshot(app_name: str) -> dict | None:
    import ray

    from raylane.deployments.metrics.aggregator import get_aggregator

    try:
        return ray.get(get_aggregator(app_name, create=False).snapshot.remote(), timeout=30)
    except (ValueError, ray.exceptions.RayError):
        return None


def _add_load(rows: list[PoolRow], snapshot: dict, app_wide: dict) -> None:
    by_name = {r.name: r for r in rows}
    replicas: dict[str, ReplicaRow] = {}
    for (family, _, labels), value in snapshot["gauges"].items():
        labels = dict(labels)
        row = by_name.get(labels.get("pool", ""))
        if row is None:
            continue
        row.model = labels.get("model", row.model)
        key = labels.get("replica", "?")
        if key not in replicas:
            replicas[key] = ReplicaRow(key)
            row.replicas.append(replicas[key])
        attr = {"raylane_num_requests_running": "running", "raylane_num_requests_waiting": "waiting"}
        setattr(replicas[key], attr.get(family, "kv"), value)
    past = snapshot.get("past")
    if past is None:
        return
    elapsed = snapshot["now"] - past[0]
    if elapsed <= 0:
        return
    now_totals, past_totals = snapshot["totals"], past[1]

    def increase(family: str, **want) -> dict[str, float]:
        """Increase per pool (or '' for unlabelled) of the samples of `family` matching `want`."""
        out: dict[str, float] = {}
        for key, value in now_totals.items():
            labels = dict(key[2])
            if key[0] == family and all(labels.get(k) == v for k, v in want.items()):
                pool = labels.get("pool", "")
                out[pool] = out.get(pool, 0.0) + value - past_totals.get(key, 0.0)
        return out

    generated = increase("raylane_generation_tokens")
    errors = increase("raylane_request_success", finished_reason="error")
    finished = increase("raylane_request_success")
    for row in rows:
        if row.name in generated:
            row.tokens_per_s = generated[row.name] / elapsed
        if finished.get(row.name):
            row.error_rate = errors.get(row.name, 0.0) / finished[row.name]
    http_all, http_5xx = 0.0, 0.0
    for key, value in now_totals.items():
        if key[0] == "raylane_http_requests":
            grown = value - past_totals.get(key, 0.0)
            http_all += grown
            http_5xx += grown if dict(key[2]).get("status_code", "").startswith("5") else 0.0
    app_wide["http_error_rate"] = http_5xx / http_all if http_all else None
    app_wide["window_s"] = elapsed


def render(rows: list[PoolRow], app_wide: dict) -> str:
    header = ["POOL", "MODEL", "HEALTH", "REPLICAS", "RUNNING", "WAITING", "KV USE", "TOKENS/S", "ERRORS"]
    table = [header]
    for row in rows:
        table.append(
            [
                row.name,
                row.model or "-",
                row.status,
                f"{row.replicas_running}/{row.replicas_total}",
                _num(row.running if row.replicas else None),
                _num(row.waiting if row.replicas else None),
                _pct(row.kv),
                _num(row.tokens_per_s, 1),
                _pct(row.error_rate),
            ]
        )
        for replica in sorted(row.replicas, key=lambda r: r.replica):
            table.append(
                [
                    "  " + replica.replica,
                    "",
                    "",
                    "",
                    _num(replica.running),
                    _num(replica.waiting),
                    _pct(replica.kv),
                ]
                + ["", ""]
            )
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in table
    ]
    footer = f"app: {app_wide.get('status', '?')}"
    if app_wide.get("config_generation") is not None:
        footer += f"   config generation {app_wide['config_generation']}"
    if app_wide.get("apply"):
        footer += f"   apply in progress {app_wide['apply']}"
    if app_wide.get("http_error_rate") is not None:
        footer += (
            f"   HTTP 5xx over the last {app_wide['window_s']:.0f} s: {_pct(app_wide['http_error_rate'])}"
        )
    if app_wide.get("message"):
        footer += f"   ({app_wide['message']})"
    batches = _render_batches(app_wide.get("batches") or [], app_wide.get("batch_runner") or {})
    return "\n".join([*lines, "", footer, *batches])


def _render_batches(batches: list[dict], runner: dict) -> list[str]:
    if not batches:
        return []
    table = [["BATCH", "ENDPOINT", "STATUS", "DONE", "FAILED", "TOTAL"]]
    for b in batches:
        counts = b["request_counts"]
        table.append(
            [
                b["id"],
                b["endpoint"],
                b["status"],
                str(counts["completed"]),
                str(counts["failed"]),
                str(counts["total"]),
            ]
        )
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    rendered = [
        "",
        *("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in table),
    ]
    if runner:
        rendered.append(
            f"lines in flight: {runner['in_flight']} (window {runner['window']} of "
            f"{runner['max_concurrency']}), {runner['waiting_to_retry']} waiting to retry, oldest call "
            f"{runner['oldest_call_s']:g} s"
            + (f", paused {runner['paused_s']:g} s" if runner["paused_s"] else "")
        )
    return rendered


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def run(args: argparse.Namespace) -> int:
    import ray

    if not ray.is_initialized():
        address = args.address or os.environ.get("RAY_ADDRESS") or "auto"
        try:
            ray.init(address=address, namespace="raylane", log_to_driver=False, logging_level="ERROR")
        except ConnectionError as e:
            print(f"raylane status: no Ray cluster at {address}: {e}", file=sys.stderr)
            return 2
    try:
        rows, app_wide = collect(args.app)
    except LookupError as e:
        print(f"raylane status: {e}", file=sys.stderr)
        return 1
    print(render(rows, app_wide))
    return 0
