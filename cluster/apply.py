"""`raylane apply --config NEW.yaml`: change a running cluster to a new config without downtime.

The difference to the config the app serves (recorded by `raylane serve` and each apply:
deployments/live_config.py) decides what happens:

- gateway settings (API keys, tiers, rate limits, routes, fallbacks, router thresholds, pool
  admission limits): every gateway replica takes them in place (`Gateway.reconfigure`), with no
  restart; requests in flight keep their slots and keys their rate-limit spending;
- a new pool starts while the others serve; the gateway routes to it once it runs;
- a changed pool (model, engine settings, parallelism) rolls a replica at a time: Serve starts a
  new replica, waits until it runs, then stops an old one, which finishes its requests and streams
  first (`GRACEFUL_SHUTDOWN_TIMEOUT_S`); replica count, routing and health-check settings apply
  without a restart;
- a removed pool gets no new requests once the gateway has the new config, then drains and stops.

In three deploys, so that no request is sent where nothing can serve it: (1) new and changed pools
start beside the running ones while the gateway keeps the old config; (2) the gateway takes the new
config; (3) removed pools are deleted. If a new or changed pool does not run within the timeout, or
Serve gives up starting it, the old config is deployed again (its replicas never stopped) and the
apply fails naming the pool. `--dry-run` prints the plan and changes nothing; an invalid config
changes nothing and names the field.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from raylane.config import ClusterConfig, ConfigError
from raylane.deployments import live_config
from raylane.deployments.live_config import POOL_FIELDS_OUTSIDE_THE_REPLICA, LiveState

# The listener is Ray's, fixed when Serve starts: these cannot change under a running cluster.
FIXED_FIELDS = ("http.host", "http.port", "http.ingress")
POLL_S = 0.5
DEFAULT_TIMEOUT_S = 600.0


class ApplyError(RuntimeError):
    """The apply did not happen, or was undone; the message says why."""


@dataclass
class Plan:
    in_place: list[str] = field(default_factory=list)  # gateway settings, applied on its replicas
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    rolled: dict[str, list[str]] = field(default_factory=dict)  # pool -> replica settings changed
    adjusted: dict[str, list[str]] = field(default_factory=dict)  # pool -> settings applied without restart

    @property
    def empty(self) -> bool:
        return not (self.in_place or self.added or self.removed or self.rolled or self.adjusted)

    def lines(self) -> list[str]:
        if self.empty:
            return ["nothing to change: the cluster already runs this config"]
        out = []
        if self.in_place:
            out.append(f"in place on the gateway replicas: {', '.join(self.in_place)}")
        out += [f"pool {name}: start (new pool)" for name in self.added]
        out += [
            f"pool {name}: rolling restart, one replica at a time ({', '.join(fields)})"
            for name, fields in self.rolled.items()
        ]
        out += [
            f"pool {name}: in place, no restart ({', '.join(fields)})"
            for name, fields in self.adjusted.items()
        ]
        out += [f"pool {name}: drain, then stop (removed)" for name in self.removed]
        return out


def changed_fields(old, new, prefix: str = "") -> list[str]:
    """Dotted paths of the fields that differ between two dumps (values never shown: keys are secret)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in dict.fromkeys([*old, *new]):
            out += changed_fields(old.get(key), new.get(key), f"{prefix}.{key}" if prefix else str(key))
        return out
    return [] if old == new else [prefix]


def plan_changes(old: ClusterConfig, new: ClusterConfig) -> Plan:
    """What applying `new` over `old` does; ConfigError naming the field when it cannot be applied."""
    plan = Plan()
    # Keys compared as digests: the running config's record holds only those.
    old, new = old.with_key_digests(), new.with_key_digests()
    before, after = old.model_dump(exclude={"pools"}), new.model_dump(exclude={"pools"})
    changed = changed_fields(before, after)
    if fixed := [f for f in changed if f in FIXED_FIELDS]:
        raise ConfigError(
            f"{fixed[0]}: cannot change on a running cluster (the listener is Ray's, fixed when Serve "
            "starts): stop it and start it with the new config"
        )
    # An inline key is a dict key: name the field, never the key.
    plan.in_place = sorted({"api_keys.keys" if f.startswith("api_keys.keys.") else f for f in changed})
    old_pools = {p.name: p for p in old.pools}
    for pool in new.pools:
        if pool.name not in old_pools:
            plan.added.append(pool.name)
            continue
        fields = changed_fields(old_pools[pool.name].model_dump(), pool.model_dump())
        restart = [f for f in fields if f.split(".")[0] not in POOL_FIELDS_OUTSIDE_THE_REPLICA]
        if restart:
            plan.rolled[pool.name] = restart
        elif fields:
            plan.adjusted[pool.name] = fields
    plan.removed = [name for name in old_pools if name not in {p.name for p in new.pools}]
    return plan


# -- Serve's view ----------------------------------------------------------------------------------


def _deployment(app: str, name: str):
    from ray import serve

    status = serve.status().applications.get(app)
    return None if status is None else status.deployments.get(name)


def _replica_ids(app: str, deployment: str) -> set[str]:
    import ray

    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    return {
        a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)
    }


def _deploy(app_builder, app: str, route_prefix: str | None) -> None:
    from ray import serve

    serve.run_many(
        [serve.RunTarget(target=app_builder, name=app, route_prefix=route_prefix)],
        wait_for_applications_running=False,
    )


def _wait(what: str, ready: Callable[[], bool], timeout_s: float, log: Callable[[str], None]) -> None:
    """Until `ready()`; ApplyError past `timeout_s`. `ready` raises ApplyError when Serve gave up."""
    deadline, said = time.monotonic() + timeout_s, time.monotonic()
    while not ready():
        if time.monotonic() > deadline:
            raise ApplyError(f"{what}: not ready within {timeout_s:g} s")
        if time.monotonic() - said > 30:
            log(f"raylane apply: still waiting for {what}")
            said = time.monotonic()
        time.sleep(POLL_S)


def _reason(message: str) -> str:
    """The exception a Serve status message ends its traceback with, else its end."""
    errors = [line for line in message.splitlines() if re.match(r"^[\w.]+(Error|Exception): ", line)]
    return (errors[-1] if errors else message.strip().splitlines()[-1] if message.strip() else "?")[:400]


def _pool_ready(app: str, pool: str, old_replicas: set[str]) -> Callable[[], bool]:
    """A new pool, or a changed one whose replicas are all new: running at its target, healthy."""
    from raylane.deployments.gateway.pool_health import pool_deployment_name

    name = pool_deployment_name(pool)

    def ready() -> bool:
        status = _deployment(app, name)
        if status is None:
            return False
        if status.status in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise ApplyError(f"pool {pool}: its new replicas failed to start: {_reason(status.message)}")
        return status.status == "HEALTHY" and not (_replica_ids(app, name) & old_replicas)

    return ready


def _pool_back(app: str, pool: str, old_replicas: set[str]) -> Callable[[], bool]:
    """A rolled-back pool: healthy, and only its old replicas left."""
    from raylane.deployments.gateway.pool_health import pool_deployment_name

    name = pool_deployment_name(pool)

    def ready() -> bool:
        status = _deployment(app, name)
        return status is not None and status.status == "HEALTHY" and _replica_ids(app, name) <= old_replicas

    return ready


def _gateway_ready(app: str, generation: int) -> Callable[[], bool]:
    """Every gateway replica has taken the config of `generation` (each acknowledges it)."""

    def ready() -> bool:
        status = _deployment(app, "Gateway")
        if status is not None and status.status in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise ApplyError(f"the gateway did not take the new config: {_reason(status.message)}")
        replicas = {name.rsplit("#", 1)[1] for name in _replica_ids(app, "Gateway")}
        acks = live_config.acknowledged(app)
        return bool(replicas) and all(acks.get(r) == generation for r in replicas)

    return ready


# -- the apply -------------------------------------------------------------------------------------


def deploy_live(config: ClusterConfig, app: str, route_prefix: str | None = "/") -> LiveState:
    """Deploy `config` as app `app`, recorded so that `apply_config` can change it later (what
    `raylane serve` does); returns once every replica runs (serve.run)."""
    from ray import serve

    from raylane.deployments.app import build_live_app

    previous = live_config.read_state(app)
    state = live_config.publish(app, config, route_prefix, previous)
    serve.run(build_live_app(config, state), name=app, route_prefix=route_prefix)
    return state


def apply_config(
    new: ClusterConfig,
    app: str,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    dry_run: bool = False,
    log: Callable[[str], None] = print,
) -> Plan:
    """Change the running app `app` to `new` (see the module doc); returns the plan carried out.
    ApplyError when it could not (nothing changed, or the change was undone); ConfigError for a
    config that cannot be applied."""
    from raylane.deployments.app import build_live_app
    from raylane.deployments.gateway.pool_health import pool_deployment_name

    running = live_config.running_config(app)
    if running is None:
        raise ApplyError(
            f"no raylane app {app!r} with a recorded config is running here (start it: raylane serve)"
        )
    state, old = running
    plan = plan_changes(old, new)
    for line in plan.lines():
        log(f"raylane apply: {line}")
    if dry_run or plan.empty:
        return plan
    if state.apply is not None and time.time() - state.apply["started"] < timeout_s:
        raise ApplyError(f"another apply (generation {state.apply['generation']}) is in progress")
    prefix = state.route_prefix
    removed = [old.pool(name) for name in plan.removed]
    new_state = LiveState(state.generation + 1, live_config.store(app, new), prefix, state.applies, None)
    started = time.monotonic()
    progress = {"started": time.time(), "generation": new_state.generation, "step": "start"}
    progress["pools"] = {n: "start" for n in plan.added} | {n: "roll" for n in plan.rolled}
    live_config.write_state(app, _with(state, apply=progress))
    old_replicas = {n: _replica_ids(app, pool_deployment_name(n)) for n in plan.rolled}
    try:
        # 1. New and changed pools start beside the running ones; the gateway keeps the old config.
        if plan.added or plan.rolled or plan.adjusted:
            _deploy(build_live_app(new, state, removed), app, prefix)
            for name in [*plan.added, *plan.rolled]:
                _wait(f"pool {name}", _pool_ready(app, name, old_replicas.get(name, set())), timeout_s, log)
                log(f"raylane apply: pool {name} runs the new config ({time.monotonic() - started:.1f} s)")
    except ApplyError as e:
        log(f"raylane apply: {e}; rolling back to generation {state.generation}")
        _deploy(build_live_app(old, state), app, prefix)  # the old replicas never stopped
        for name in plan.rolled:  # until the replicas that failed to start are gone
            _wait(f"pool {name} back", _pool_back(app, name, old_replicas[name]), timeout_s, log)
        _finish(app, state, "rolled_back")
        raise ApplyError(f"{e}; the cluster still runs generation {state.generation}") from None
    except BaseException:
        _finish(app, state, "failed")
        raise
    # 2. The gateway takes the new config in place; removed pools get no new requests from here.
    live_config.write_state(app, _with(state, apply=progress | {"step": "gateway"}))
    _deploy(build_live_app(new, new_state, removed), app, prefix)
    try:
        _wait("the gateway", _gateway_ready(app, new_state.generation), timeout_s, log)
    except ApplyError:
        _finish(app, state, "failed")
        raise
    took = time.monotonic() - started
    log(f"raylane apply: the gateway serves generation {new_state.generation} ({took:.1f} s)")
    published = live_config.publish(app, new, prefix, state)
    # 3. Removed pools: Serve stops each replica once its requests and streams are done.
    if removed:
        _deploy(build_live_app(new, published), app, prefix)
        log(f"raylane apply: draining and stopping {', '.join(plan.removed)}")
    _finish(app, published, "applied")
    took = time.monotonic() - started
    log(f"raylane apply: done in {took:.1f} s (generation {published.generation})")
    return plan


def _with(state: LiveState, **changes) -> LiveState:
    return LiveState(**(state.__dict__ | changes))


def _finish(app: str, state: LiveState, result: str) -> None:
    """Count the apply's result (`raylane_config_applies_total{result}`) and clear its progress."""
    applies = dict(state.applies)
    applies[result] = applies.get(result, 0) + 1
    live_config.write_state(app, _with(state, applies=applies, apply=None))
    try:
        import ray

        from raylane.deployments.metrics.aggregator import get_aggregator
        from raylane.deployments.metrics.metric_set import sample_key

        family = "raylane_config_applies"
        families = {family: ("counter", "Config applies (raylane apply), by result.")}
        deltas = {sample_key(family, f"{family}_total", {"result": result}): 1.0}
        # Waited for: the command disconnects from Ray right after, which could drop the report.
        report = get_aggregator(app).report.remote(f"apply-{uuid.uuid4().hex[:8]}", 1, families, deltas, {})
        ray.get(report, timeout=30)
    except Exception as e:  # the counter is a convenience: the apply itself is done
        print(f"raylane apply: could not count the apply in the metrics: {e!r}", file=sys.stderr)


# -- the command -----------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="the new cluster config YAML")
    parser.add_argument("--dry-run", action="store_true", help="print what would change, change nothing")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds a new or changed pool may take to run before the apply is rolled back",
    )
    parser.add_argument("--app", default=None, help="Serve app name (default: raylane)")


def run(args: argparse.Namespace) -> int:
    import os

    import ray

    from raylane.deployments.app import APP_NAME
    from raylane.models.sources import missing_checkpoints

    try:
        config = ClusterConfig.from_yaml(args.config)
    except ConfigError as e:
        print(f"raylane apply: {e}", file=sys.stderr)
        return 2
    if missing := missing_checkpoints(config):
        print("raylane apply: " + "; ".join(missing), file=sys.stderr)
        return 2
    try:
        ray.init(address=os.environ.get("RAY_ADDRESS") or "auto", namespace="raylane", log_to_driver=False)
    except ConnectionError:
        print("raylane apply: no Ray cluster is running here (set RAY_ADDRESS to join one)", file=sys.stderr)
        return 2
    try:
        apply_config(config, args.app or APP_NAME, timeout_s=args.timeout, dry_run=args.dry_run)
        return 0
    except ConfigError as e:
        print(f"raylane apply: {e}", file=sys.stderr)
        return 2
    except ApplyError as e:
        print(f"raylane apply: {e}", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
