"""`raylane k8s render`: the KubeRay manifests of a cluster config.

From one `ClusterConfig` it writes a kustomize directory:

- `rayservice.yaml`: a `RayService` (ray.io/v1). Its `serveConfigV2` names the same application
  builder `raylane serve` deploys (`raylane.deployments.app:build_app`, the config itself as `args`), so
  what runs on Kubernetes is what runs locally. Worker groups follow the pools: one pod hosts one
  replica (all its ranks, `nvidia.com/gpu` = ranks on GPU pools) and advertises a Ray resource
  `raylane_pool_<name>` that the pool's first placement-group bundle asks for, so each pool's
  replicas land on its own group; a CPU `gateway` group holds the gateway (and its router). The
  head runs no replicas (`num-cpus: 0`) and has no GPU. `upgradeStrategy: NewCluster`: a changed
  cluster spec (image, groups) starts a new RayCluster and moves traffic once it serves; a changed
  `serveConfigV2` alone is rolled out in place by Serve. The `router` and `embeddings` sections
  are the Gateway deployment's `user_config`, not `args`, so an edit of them reconfigures the
  gateway's replicas and restarts no pool. Ray's token authentication is on
  (`authOptions.mode: token`, KubeRay >= 1.5.1, Ray >= 2.52): the operator generates the token
  Secret and sets RAY_AUTH_MODE / RAY_AUTH_TOKEN in every Ray container, so GCS, dashboard and
  client answer only holders of the token (the health endpoints the probes use stay open).
- `podmonitor.yaml`: Prometheus scrapes Ray's metrics port (8080) on every pod directly. No Service
  exposes a Ray port: the only Service rendered is the RayService's `serveService` (the OpenAI
  port); the head Service KubeRay creates for the workers is cluster-internal.
- `pdb.yaml`: at most one raylane pod down at a time for voluntary disruptions.
- `networkpolicy.yaml`: from anywhere, only the HTTP port; the metrics port from Prometheus pods
  (label `app.kubernetes.io/name: prometheus`, any namespace); the Ray pods talk freely among
  themselves; the dashboard only to the KubeRay operator (it deploys `serveConfigV2` and submits
  `RayJob`s through it). GCS and client ports are never opened.
- `kustomization.yaml`.

With `--base DIR` the output is an overlay of that directory instead: `resources: [DIR]` and one
JSON patch per object that differs. `--jobs DIR` writes the ops `RayJob`s (cluster/jobs/).
API keys come from the Secret `<name>-api-keys`: key `keys` (the key file format of `api_keys`),
mounted at `api_keys.file` or set as the variable `api_keys.env` in the gateway's pods only (the
pools' pods run model code and never see them); its optional `ops-key` is the key the ops jobs use,
on the head. Keys written inline in the config cannot go into a manifest and are refused. The
`--demo-secret` key is public: it gets open mode's tier (`api_keys.default_tier`), never a
privileged one. Every container runs with a read-only root filesystem (emptyDirs for /tmp, where
Ray keeps its session, and for the cache) and no pod mounts a service account token, except the
head when a pool autoscales (KubeRay's autoscaler sidecar calls the Kubernetes API).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from raylane.cluster.serve_env import SERVE_ENV
from raylane.config import GATEWAY_SECTIONS

HTTP_PORT_NAME, METRICS_PORT, DASHBOARD_PORT, GCS_PORT, CLIENT_PORT = "serve", 8080, 8265, 6379, 10001
AGENT_PORT = 52365
DEFAULT_IMAGE = "raylane:latest"
RAY_VERSION = "2.60.0"
GATEWAY_RESOURCE = "raylane_gateway"
OPS_KEY_ENV = "RAYLANE_API_KEY"
JOBS = ("smoke", "warmup", "bench", "route_eval")
CLUSTER_PLACEHOLDER = "RAYCLUSTER_NAME"  # RayJob clusterSelector: the RayService's active RayCluster
REPO = Path(__file__).resolve().parents[1]
# The checked-in manifests and the arguments they are rendered with (tests compare them).
CHECKED_IN: dict[str, list[str]] = {
    "k8s/base": ["--config", "k8s/configs/cpu-demo.yaml", "--jobs", "k8s/jobs"],
    "k8s/overlays/cpu-demo": ["--config", "k8s/configs/cpu-demo.yaml", "--base", "k8s/base", "--demo-secret"],
    "k8s/overlays/gpu": [
        "--config", "k8s/configs/gpu.yaml", "--base", "k8s/base", "--image", "raylane:latest-gpu",
        "--redis-address", "redis.raylane.svc:6379", "--redis-password-secret", "raylane-redis",
    ],
}  # fmt: skip
DEMO_KEY = "raylane-demo-key"  # the cpu-demo overlay's generated Secret: a public key, for demos only


class RenderError(ValueError):
    """The config cannot be expressed as manifests (the message names the field)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="k8s_command", required=True)
    render = sub.add_parser("render", help="write the RayService, PodMonitor, PDB and NetworkPolicy")
    render.add_argument("--config", help="cluster config YAML (default: the embedded demo config)")
    render.add_argument("--image", default=DEFAULT_IMAGE, help=f"container image (default {DEFAULT_IMAGE})")
    render.add_argument("--out", type=Path, help="directory to write (default: print one YAML stream)")
    render.add_argument("--name", default="raylane", help="RayService name and label (default raylane)")
    render.add_argument("--base", type=Path, help="write an overlay of this rendered base directory")
    render.add_argument("--jobs", type=Path, help="also write the ops RayJobs into this directory")
    render.add_argument("--redis-address", help="GCS fault tolerance: external Redis HOST:PORT")
    render.add_argument("--redis-password-secret", help="Secret (key `password`) with the Redis password")
    render.add_argument("--models-pvc", default="raylane-models", help="PVC holding checkpoint directories")
    render.add_argument("--models-dir", default="/models", help="where the PVC is mounted (default /models)")
    render.add_argument("--gpus-per-node", type=int, default=8, help="GPUs of one node (default 8)")
    render.add_argument("--demo-secret", action="store_true", help="generate the API-key Secret (demo key)")
    render.add_argument(
        "--incremental-upgrade",
        metavar="GATEWAY_CLASS",
        help="upgrade a changed cluster spec by KubeRay's NewClusterWithIncrementalUpgrade through this "
        "Gateway API class (KubeRay >= 1.5.1, feature gate RayServiceIncrementalUpgrade): the new cluster "
        "grows and takes traffic in steps, without room for two whole clusters",
    )
    sub.add_parser("sync", help="re-render every checked-in directory under k8s/ (see CHECKED_IN)")


def run(args: argparse.Namespace) -> int:
    from raylane.config import ConfigError

    try:
        if args.k8s_command == "sync":
            for out, argv in CHECKED_IN.items():
                write_dir(REPO / out, render_files(parse_render_args([*argv, "--out", out], REPO)))
                print(f"raylane k8s: wrote {out}")
            return 0
        files = render_files(args)
    except (ConfigError, RenderError) as e:
        print(f"raylane k8s render: {e}", file=sys.stderr)
        return 2
    if args.out is None:
        objects = [text for name, text in files.items() if name != "kustomization.yaml"]
        print("---\n".join(objects), end="")
    else:
        write_dir(args.out, files)
    return 0


def parse_render_args(argv: list[str], root: Path) -> argparse.Namespace:
    """The render arguments of a CHECKED_IN entry, paths taken from `root`."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["render", *argv])
    for field in ("config", "base", "jobs", "out"):
        if getattr(args, field) is not None:
            setattr(args, field, str(root / getattr(args, field)))
    for field in ("base", "jobs", "out"):
        setattr(args, field, Path(getattr(args, field)) if getattr(args, field) else None)
    return args


def write_dir(out: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


# -- rendering ------------------------------------------------------------------------------------


def render_files(args: argparse.Namespace) -> dict[str, str]:
    """File name (relative to --out; `jobs/...` under --jobs) -> YAML text."""
    from raylane.config import ClusterConfig, default_config

    config = ClusterConfig.from_yaml(args.config) if args.config else default_config()
    objects = render_objects(config, args)
    files = overlay_files(objects, args, config) if args.base else base_files(objects)
    if args.jobs:
        out = Path(args.out) if args.out else None
        prefix = os.path.relpath(args.jobs, out) if out else "jobs"
        for job, obj in render_jobs(config, args.name).items():
            files[f"{prefix}/{job.replace('_', '-')}.yaml"] = dump(obj, header=JOB_HEADER)
    return files


HEADER = "# Rendered by `raylane k8s render` (cluster/k8s.py); edit the config and re-render.\n"
JOB_HEADER = (
    HEADER + "# Submit against the active RayCluster of the RayService (k8s/RUNBOOK.md):\n"
    f"#   sed s/{CLUSTER_PLACEHOLDER}/$(kubectl get rayservice raylane"
    " -o jsonpath='{.status.activeServiceStatus.rayClusterName}')/ FILE | kubectl create -f -\n"
)


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (serveConfigV2) as literal blocks, so the manifest reads as YAML."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump(obj: Any, header: str = HEADER) -> str:
    return header + yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=110)


def base_files(objects: dict[str, dict]) -> dict[str, str]:
    files = {f"{name}.yaml": dump(obj) for name, obj in objects.items()}
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": list(files),
    }
    return {**files, "kustomization.yaml": dump(kustomization)}


def demo_tier(config) -> str:
    """The tier of the public demo key: open mode's tier (anyone holding a published key is anyone),
    and never a privileged one: the highest priority, or no request or token limit."""
    if config.api_keys.default_tier is None:
        raise RenderError(
            "api_keys.default_tier: --demo-secret gives the public demo key open mode's tier, and none "
            "is set (the built-in `open` tier has no limits): name a rate-limited tier"
        )
    tier = {t.name: t for t in config.tiers}[config.api_keys.default_tier]
    if privileged(tier, config.tiers):
        raise RenderError(
            f"api_keys.default_tier: {tier.name!r} is privileged (top priority, or no request or token "
            "limit); --demo-secret gives the public demo key that tier"
        )
    return tier.name


def privileged(tier, tiers) -> bool:
    unlimited = tier.requests_per_minute is None or tier.tokens_per_minute is None
    return unlimited or tier.priority == min(t.priority for t in tiers)


def overlay_files(objects: dict[str, dict], args: argparse.Namespace, config) -> dict[str, str]:
    """`resources: [base]` plus a JSON patch replacing `spec` of each object that differs."""
    base_dir = Path(args.base)
    out = Path(args.out) if args.out else base_dir
    kustomization: dict[str, Any] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(base_dir, out)],
    }
    files: dict[str, str] = {}
    patches = []
    for name, obj in objects.items():
        path = base_dir / f"{name}.yaml"
        base = yaml.safe_load(path.read_text()) if path.is_file() else None
        if base is None:
            files[f"{name}.yaml"] = dump(obj)
            kustomization["resources"].append(f"{name}.yaml")
        elif base != obj:
            if base["metadata"] != obj["metadata"]:
                raise RenderError(f"--base: {name} has other metadata in {base_dir}; use another --name")
            patch = [{"op": "replace", "path": "/spec", "value": obj["spec"]}]
            files[f"{name}-patch.yaml"] = dump(patch)
            group, _, version = obj["apiVersion"].rpartition("/")
            target = {
                "group": group,
                "version": version,
                "kind": obj["kind"],
                "name": obj["metadata"]["name"],
            }
            patches.append({"path": f"{name}-patch.yaml", "target": {k: v for k, v in target.items() if v}})
    if patches:
        kustomization["patches"] = patches
    if args.demo_secret:
        kustomization["generatorOptions"] = {"disableNameSuffixHash": True}
        kustomization["secretGenerator"] = [
            {
                "name": f"{args.name}-api-keys",
                "literals": [f"keys={DEMO_KEY} {demo_tier(config)}", f"ops-key={DEMO_KEY}"],
            }
        ]
    return {**files, "kustomization.yaml": dump(kustomization)}


def render_objects(config, args: argparse.Namespace) -> dict[str, dict]:
    if config.http.ingress != "proxy":  # probes and the Service would need HAProxy's ports and health
        raise RenderError("http.ingress: the KubeRay manifests support proxy only, for now")
    name = args.name
    return {
        "rayservice": ray_service(config, args),
        "pdb": disruption_budget(name),
        "networkpolicy": network_policy(name, config.http.port),
        "podmonitor": pod_monitor(name),
    }


def labels(name: str, component: str | None = None) -> dict[str, str]:
    out = {"app.kubernetes.io/name": "raylane", "app.kubernetes.io/instance": name}
    return out | ({"app.kubernetes.io/component": component} if component else {})


def pool_resource(pool_name: str) -> str:
    return f"raylane_pool_{pool_name.replace('-', '_')}"


# -- serveConfigV2 --------------------------------------------------------------------------------


def app_args(config) -> dict[str, Any]:
    """The config as the application builder's `args` (JSON-safe; no secrets), less the sections
    the gateway alone reads (`gateway_sections`). Tiers and keys stay here: the args must validate
    alone, and keys name tiers (the keys themselves come from the Secret, re-read as it changes)."""
    if config.api_keys.keys:
        raise RenderError(
            "api_keys.keys: inline keys cannot go into a manifest; "
            "use api_keys.file or api_keys.env (filled from the Secret)"
        )
    return config.model_dump(mode="json", exclude_defaults=True, exclude=set(GATEWAY_SECTIONS))


def gateway_sections(config) -> dict[str, Any]:
    """The Gateway deployment's Serve `user_config`: the sections only it reads (GATEWAY_SECTIONS),
    taken in place by `Gateway.reconfigure`, so that editing the routes or the embeddings settings
    in serveConfigV2 restarts no pool."""
    sections = config.model_dump(mode="json", exclude_defaults=True, include=set(GATEWAY_SECTIONS))
    return {"sections": sections}


# A replica is pinned to a pod of its group, and the groups hold as many pods as replicas: a surge
# replica would wait for a pod that never comes. So on Kubernetes a rolling restart stops an old
# replica before its replacement starts (Serve's default), where `raylane serve` surges by one.
NO_SURGE = 0


def serve_config(config) -> dict[str, Any]:
    """Serve's declarative config: the same builder and options `raylane serve` deploys, plus the
    Ray resources that pin each pool to its worker group."""
    from raylane.deployments.app import APP_NAME, gateway_deployment_options, pool_deployment_options

    deployments = []
    for pool in config.pools:
        options = pool_deployment_options(pool)
        bundles = [dict(b) for b in options["placement_group_bundles"]]
        bundles[0][pool_resource(pool.name)] = 1
        deployments.append(
            {"name": options["name"], "placement_group_bundles": bundles, "max_surge_percent": NO_SURGE}
        )
    gateway = gateway_deployment_options(config)
    actor = {**gateway["ray_actor_options"], "resources": {GATEWAY_RESOURCE: 1}}
    deployments.append(
        {
            "name": gateway["name"],
            "ray_actor_options": actor,
            "max_surge_percent": NO_SURGE,
            "user_config": gateway_sections(config),
        }
    )
    http: dict[str, Any] = {"host": "0.0.0.0", "port": config.http.port}
    if config.http.request_timeout_s is not None:
        http["request_timeout_s"] = config.http.request_timeout_s
    return {
        "proxy_location": "EveryNode",
        "http_options": http,
        "applications": [
            {
                "name": APP_NAME,
                "route_prefix": "/",
                "import_path": "raylane.deployments.app:build_app",
                "args": app_args(config),
                "deployments": deployments,
            }
        ],
    }


# -- pods -----------------------------------------------------------------------------------------


def probe(commands: list[str], period: int, failures: int, initial: int = 10) -> dict:
    return {
        "exec": {"command": ["bash", "-c", " && ".join(commands)]},
        "initialDelaySeconds": initial,
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def _wget(url: str) -> str:
    return f"wget -T 4 -q -O- {url} | grep -q success"


RAYLET_OK = _wget(f"http://localhost:{AGENT_PORT}/api/local_raylet_healthz")
GCS_OK = _wget(f"http://localhost:{DASHBOARD_PORT}/api/gcs_healthz")


# Writable places under a read-only root filesystem: /tmp (Ray's session directory, sockets, the
# grammar forkserver) and the cache (demo checkpoints, the router's fitted head, HF and Triton caches).
CACHE_DIR = "/home/ray/.cache"
SCRATCH = {"tmp": "/tmp", "cache": CACHE_DIR}


def container(
    config, args, role: str, component: str, cpu: float, memory_gi: int, gpus: int, models: bool
) -> dict[str, Any]:
    port = config.http.port
    ports = [
        {"name": HTTP_PORT_NAME, "containerPort": port},
        {"name": "metrics", "containerPort": METRICS_PORT},
    ]
    if role == "head":
        ports += [
            {"name": "gcs", "containerPort": GCS_PORT},
            {"name": "dashboard", "containerPort": DASHBOARD_PORT},
            {"name": "client", "containerPort": CLIENT_PORT},
        ]
        ready = probe([RAYLET_OK, GCS_OK], period=5, failures=10)
        live = probe([RAYLET_OK, GCS_OK], period=5, failures=120, initial=30)
    else:  # a worker is ready once its Serve proxy answers
        ready = probe(
            [RAYLET_OK, f"wget -T 4 -q -O- http://localhost:{port}/-/healthz"], period=5, failures=10
        )
        live = probe([RAYLET_OK], period=5, failures=120, initial=30)
    resources = {"cpu": _cpu(cpu), "memory": f"{memory_gi}Gi"} | ({"nvidia.com/gpu": gpus} if gpus else {})
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    mounts += [{"name": name, "mountPath": path} for name, path in SCRATCH.items()]
    if models:
        mounts.append({"name": "models", "mountPath": args.models_dir, "readOnly": True})
    env = [
        {"name": "RAYLANE_DEMO_DIR", "value": f"{CACHE_DIR}/raylane/demo-models"},
        {"name": "TRITON_CACHE_DIR", "value": f"{CACHE_DIR}/triton"},  # its default, ~/.triton, is read-only
    ]
    env += [{"name": name, "value": value} for name, value in SERVE_ENV.items()]
    keys = config.api_keys
    secret = f"{args.name}-api-keys"
    # Only the gateway checks keys: pool pods (their ranks, and anything a model's code runs) never
    # see them, and the head gets only the ops jobs' own key.
    if keys.file and component == "gateway":
        mounts.append({"name": "api-keys", "mountPath": os.path.dirname(keys.file), "readOnly": True})
    if keys.env and component == "gateway":
        env.append({"name": keys.env, "valueFrom": {"secretKeyRef": {"name": secret, "key": "keys"}}})
    if role == "head":  # the ops jobs run here and authenticate with the Secret's ops key
        ref = {"name": secret, "key": "ops-key", "optional": True}
        env.append({"name": OPS_KEY_ENV, "valueFrom": {"secretKeyRef": ref}})
    return {
        "name": "ray-head" if role == "head" else "ray-worker",
        "image": args.image,
        "imagePullPolicy": "IfNotPresent",
        "ports": ports,
        "env": env,
        "resources": {"requests": resources, "limits": resources},
        "readinessProbe": ready,
        "livenessProbe": live,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
            "readOnlyRootFilesystem": True,
        },
        "volumeMounts": mounts,
    }


def _cpu(cpu: float) -> str | int:
    return int(cpu) if float(cpu).is_integer() else f"{int(cpu * 1000)}m"


def pod_template(config, args, role: str, component: str, cpu, memory_gi, gpus, models) -> dict[str, Any]:
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    volumes += [{"name": name, "emptyDir": {}} for name in SCRATCH]
    if models:
        claim = {"claimName": args.models_pvc, "readOnly": True}
        volumes.append({"name": "models", "persistentVolumeClaim": claim})
    if config.api_keys.file and component == "gateway":
        path = os.path.basename(config.api_keys.file)
        secret = {"secretName": f"{args.name}-api-keys", "items": [{"key": "keys", "path": path}]}
        volumes.append({"name": "api-keys", "secret": secret})
    # No pod talks to the Kubernetes API, except the head's autoscaler sidecar (KubeRay adds it when
    # a pool autoscales), which uses the head's service account token.
    autoscaler = role == "head" and any(p.replicas.autoscaling for p in config.pools)
    spec: dict[str, Any] = {
        "automountServiceAccountToken": autoscaler,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "runAsGroup": 100,
            "fsGroup": 100,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container(config, args, role, component, cpu, memory_gi, gpus, models)],
        "volumes": volumes,
    }
    if gpus:
        spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return {"metadata": {"labels": labels(args.name, component)}, "spec": spec}


def uses_models_volume(config, args) -> bool:
    paths = [(i, p) for i, p in enumerate(config.pools) if p.demo_model is None and p.packaged_model is None]
    root = args.models_dir.rstrip("/") + "/"
    for i, pool in paths:
        if not pool.model.startswith(root):
            raise RenderError(
                f"pools[{i}] ({pool.name}).model: {pool.model} is not under --models-dir {args.models_dir} "
                f"(the PVC {args.models_pvc} mounted in every pod)"
            )
    return bool(paths)


def worker_group(config, args, pool, models: bool) -> dict[str, Any]:
    """One pod per replica: its ranks, their CPUs and GPUs, and the pool's pinning resource."""
    from raylane.deployments.app import pool_deployment_options

    bundles = pool_deployment_options(pool)["placement_group_bundles"]
    gpus = int(sum(b.get("GPU", 0) for b in bundles))
    if gpus > args.gpus_per_node:
        raise RenderError(
            f"pools ({pool.name}): a replica needs {gpus} GPUs, "
            f"more than --gpus-per-node {args.gpus_per_node} (one node hosts a replica's ranks)"
        )
    cpu = max(1.0, math.ceil(sum(b["CPU"] for b in bundles)), 4.0 * gpus)
    memory = 8 + 16 * gpus if gpus else 2 + math.ceil(pool.world_size)
    replicas = pool.replicas
    initial = replicas.initial_replicas if replicas.initial_replicas is not None else replicas.min_replicas
    return {
        "groupName": f"pool-{pool.name.replace('_', '-')}",
        "replicas": initial,
        "minReplicas": replicas.min_replicas,
        "maxReplicas": replicas.max_replicas,
        "resources": {pool_resource(pool.name): "1"},
        "rayStartParams": {"metrics-export-port": str(METRICS_PORT)},
        "template": pod_template(config, args, "worker", "pool", cpu, memory, gpus, models),
    }


def gateway_group(config, args) -> dict[str, Any]:
    """One pod per gateway replica (the router's classifier runs in the gateway)."""
    n = config.gateway.num_replicas
    cpu = max(1.0, math.ceil(config.gateway.num_cpus))
    return {
        "groupName": "gateway",
        "replicas": n,
        "minReplicas": n,
        "maxReplicas": n,
        "resources": {GATEWAY_RESOURCE: "1"},
        "rayStartParams": {"metrics-export-port": str(METRICS_PORT)},
        "template": pod_template(config, args, "worker", "gateway", cpu, 3, 0, False),
    }


# Steps of KubeRay's incremental upgrade: a quarter of the capacity (and of the traffic) a minute.
INCREMENTAL_STEP_PERCENT, INCREMENTAL_INTERVAL_S = 25, 60


def upgrade_strategy(args) -> dict[str, Any]:
    """How KubeRay replaces the cluster when its spec (image, groups) changes; a `serveConfigV2`
    change alone is applied in place by Serve either way."""
    if not getattr(args, "incremental_upgrade", None):
        return {"type": "NewCluster"}
    return {
        "type": "NewClusterWithIncrementalUpgrade",
        "clusterUpgradeOptions": {
            "gatewayClassName": args.incremental_upgrade,
            "stepSizePercent": INCREMENTAL_STEP_PERCENT,
            "intervalSeconds": INCREMENTAL_INTERVAL_S,
            "maxSurgePercent": INCREMENTAL_STEP_PERCENT,
        },
    }


def ray_service(config, args) -> dict[str, Any]:
    models = uses_models_volume(config, args)
    autoscaling = any(p.replicas.autoscaling for p in config.pools)
    cluster: dict[str, Any] = {
        "rayVersion": RAY_VERSION,
        # GCS, dashboard and Ray client refuse callers without the cluster's token (KubeRay makes it).
        "authOptions": {"mode": "token"},
        "enableInTreeAutoscaling": autoscaling,
        "headGroupSpec": {
            "rayStartParams": {
                "num-cpus": "0",  # no replica or rank on the head
                "dashboard-host": "0.0.0.0",
                "metrics-export-port": str(METRICS_PORT),
            },
            "template": pod_template(config, args, "head", "head", 2, 6, 0, models),
        },
        "workerGroupSpecs": [gateway_group(config, args)]
        + [worker_group(config, args, pool, models) for pool in config.pools],
    }
    if autoscaling:
        cluster["autoscalerOptions"] = {"upscalingMode": "Default", "idleTimeoutSeconds": 600}
    if args.redis_address:
        ft: dict[str, Any] = {"redisAddress": args.redis_address}
        if args.redis_password_secret:
            ref = {"name": args.redis_password_secret, "key": "password"}
            ft["redisPassword"] = {"valueFrom": {"secretKeyRef": ref}}
        cluster["gcsFaultToleranceOptions"] = ft
    serve_svc = {
        "metadata": {"name": f"{args.name}-serve", "labels": labels(args.name, "serve")},
        "spec": {"ports": [{"name": "http", "port": config.http.port, "targetPort": config.http.port}]},
    }
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": args.name, "labels": labels(args.name)},
        "spec": {
            "upgradeStrategy": upgrade_strategy(args),
            "serviceUnhealthySecondThreshold": 900,
            "deploymentUnhealthySecondThreshold": 900,
            "serveService": serve_svc,
            "serveConfigV2": yaml.safe_dump(serve_config(config), sort_keys=False, width=110),
            "rayClusterConfig": cluster,
        },
    }


# -- other objects --------------------------------------------------------------------------------


def pod_monitor(name: str) -> dict[str, Any]:
    """Ray's metrics port on every raylane pod, scraped directly: a Service for it would expose a Ray
    port to the whole cluster."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {"name": name, "labels": labels(name)},
        "spec": {
            "selector": {"matchLabels": labels(name)},
            "podMetricsEndpoints": [{"port": "metrics", "interval": "15s", "path": "/metrics"}],
        },
    }


def disruption_budget(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "labels": labels(name)},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels(name)}},
    }


def network_policy(name: str, http_port: int) -> dict[str, Any]:
    def pods_named(app: str) -> dict[str, Any]:  # in any namespace
        return {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": app}}}

    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "labels": labels(name)},
        "spec": {
            "podSelector": {"matchLabels": labels(name)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": labels(name)}}]},  # Ray's own traffic
                {"ports": [{"protocol": "TCP", "port": http_port}]},  # the OpenAI API, from anywhere
                {"from": [pods_named("prometheus")], "ports": [{"protocol": "TCP", "port": METRICS_PORT}]},
                {
                    "from": [pods_named("kuberay-operator")],
                    "ports": [{"protocol": "TCP", "port": DASHBOARD_PORT}],
                },
            ],
        },
    }


# -- ops jobs -------------------------------------------------------------------------------------


def job_arguments(config, job: str) -> list[str]:
    url = f"http://127.0.0.1:{config.http.port}"  # the head's own Serve proxy
    return {
        "smoke": ["--url", url],
        "warmup": ["--url", url],
        "bench": ["--url", url, "--model", config.pools[0].model_id, "--num-prompts", "64"],
        "route_eval": [],
    }[job]


def render_jobs(config, name: str) -> dict[str, dict]:
    jobs = {}
    for job in JOBS:
        entrypoint = " ".join(["python", "-m", f"raylane.cluster.jobs.{job}", *job_arguments(config, job)])
        jobs[job] = {
            "apiVersion": "ray.io/v1",
            "kind": "RayJob",
            "metadata": {"name": f"{name}-{job.replace('_', '-')}", "labels": labels(name, "ops")},
            "spec": {
                "clusterSelector": {"ray.io/cluster": CLUSTER_PLACEHOLDER},
                "submissionMode": "HTTPMode",  # the operator submits to the dashboard: no submitter pod
                "entrypoint": entrypoint,
                "entrypointNumCpus": 0,
                "activeDeadlineSeconds": 3600,
            },
        }
    return jobs
