"""The manifests under k8s/: rendered from the configs in the repo, valid for KubeRay 1.7 and Kubernetes.

KubeRay kinds are validated against the CRD schemas in `../shared/kuberay-crds/`; core kinds against
the Kubernetes OpenAPI schemas that `kubernetes-validate` ships (strict: unknown fields fail).
Overlays are validated as `kubectl kustomize` would build them.
"""

import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from raylane.cluster import k8s
from raylane.config import GATEWAY_SECTIONS, ClusterConfig

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
CRDS = SHARED / "kuberay-crds"
K8S = REPO / "k8s"
KUBERNETES_VERSION = "1.33"
KUSTOMIZE_DIRS = ["k8s/base", "k8s/overlays/cpu-demo", "k8s/overlays/gpu"]


def render(out: str) -> dict[str, str]:
    return k8s.render_files(k8s.parse_render_args([*k8s.CHECKED_IN[out], "--out", out], REPO))


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict[str, str]]:
    return {out: render(out) for out in k8s.CHECKED_IN}


@pytest.fixture(scope="module")
def crd_schemas() -> dict[str, dict]:
    if not CRDS.is_dir():
        pytest.fail(f"KubeRay CRD schemas not found at {CRDS} (shared/ beside the repo)")
    schemas = {}
    for path in CRDS.glob("ray.io_*.yaml"):
        crd = yaml.safe_load(path.read_text())
        version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
        schemas[crd["spec"]["names"]["kind"]] = version["schema"]["openAPIV3Schema"]
    return schemas


def test_checked_in_manifests_equal_the_render(rendered):
    for out, files in rendered.items():
        for name, text in files.items():
            path = REPO / out / name
            assert path.is_file(), f"{path} missing: run `raylane k8s sync`"
            assert path.read_text() == text, f"{path} differs from the render: run `raylane k8s sync`"
    written = {(REPO / out / name).resolve() for out, files in rendered.items() for name in files}
    rendered_dirs = [K8S / "base", K8S / "overlays", K8S / "jobs"]  # dashboards/ and configs/ are not
    stale = [p for d in rendered_dirs for p in d.rglob("*.yaml") if p.resolve() not in written]
    assert not stale, f"files under k8s/ that no render writes: {stale}"


# -- building kustomizations (the subset the renderer writes; checked against kubectl below) -------


def build(directory: Path) -> list[dict]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    objects: list[dict] = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        objects += build(path) if path.is_dir() else list(yaml.safe_load_all(path.read_text()))
    for patch in kustomization.get("patches", []):
        target = patch["target"]
        obj = next(
            o for o in objects if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]
        )
        for op in yaml.safe_load((directory / patch["path"]).read_text()):
            assert op["op"] == "replace" and op["path"] == "/spec", op
            obj["spec"] = op["value"]
    for generator in kustomization.get("secretGenerator", []):
        data = dict(literal.split("=", 1) for literal in generator["literals"])
        secret = {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "Opaque",
            "metadata": {"name": generator["name"]},
        }
        objects.append(secret | {"stringData": data})
    return objects


def all_objects() -> dict[str, list[dict]]:
    out = {d: build(REPO / d) for d in KUSTOMIZE_DIRS}
    out["k8s/jobs"] = [yaml.safe_load(p.read_text()) for p in sorted((K8S / "jobs").glob("*.yaml"))]
    return out


def validate(obj: dict, crd_schemas: dict) -> None:
    import kubernetes_validate

    where = f"{obj['kind']}/{obj['metadata']['name']}"
    if obj["apiVersion"].startswith("ray.io/"):
        try:
            jsonschema.Draft7Validator(crd_schemas[obj["kind"]]).validate(obj)
        except jsonschema.ValidationError as e:
            pytest.fail(f"{where}: {'.'.join(map(str, e.absolute_path))}: {e.message}")
    elif obj["kind"] == "PodMonitor":  # a Prometheus-operator CRD: no schema here; checked below
        assert obj["apiVersion"] == "monitoring.coreos.com/v1"
    else:
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{where}: {'.'.join(map(str, e.path))}: {e.message}")


@pytest.mark.parametrize("directory", [*KUSTOMIZE_DIRS, "k8s/jobs"])
def test_every_manifest_validates(directory, crd_schemas):
    objects = all_objects()[directory]
    assert objects
    kinds = {o["kind"] for o in objects}
    if directory != "k8s/jobs":
        assert {"RayService", "PodDisruptionBudget", "NetworkPolicy", "PodMonitor"} <= kinds
    else:
        assert kinds == {"RayJob"} and len(objects) == len(k8s.JOBS)
    for obj in objects:
        validate(obj, crd_schemas)


def test_a_schema_violation_is_caught(crd_schemas):
    """The validators do reject: a worker group without maxReplicas, a NetworkPolicy port as a list."""
    service = next(o for o in build(K8S / "base") if o["kind"] == "RayService")
    del service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"]
    with pytest.raises(pytest.fail.Exception, match="maxReplicas"):
        validate(service, crd_schemas)
    policy = next(o for o in build(K8S / "base") if o["kind"] == "NetworkPolicy")
    policy["spec"]["ingress"][1]["ports"][0]["port"] = [8000]
    with pytest.raises(pytest.fail.Exception, match="port"):
        validate(policy, crd_schemas)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with kustomize) not installed")
@pytest.mark.parametrize("directory", KUSTOMIZE_DIRS)
def test_kustomize_builds_the_same_objects(directory):
    result = subprocess.run(["kubectl", "kustomize", str(REPO / directory)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    built = [o for o in yaml.safe_load_all(result.stdout) if o]
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    ours = {key(o): o for o in build(REPO / directory)}
    assert {key(o) for o in built} == set(ours)
    for obj in built:
        if obj["kind"] != "Secret":  # kustomize writes generated data base64-encoded
            assert obj == ours[key(obj)]


# -- what the manifests say ----------------------------------------------------------------------


def ray_service(directory: str) -> dict:
    return next(o for o in build(REPO / directory) if o["kind"] == "RayService")


@pytest.mark.parametrize(("directory", "config"), [("k8s/base", "cpu-demo"), ("k8s/overlays/gpu", "gpu")])
def test_serve_config_is_the_builder_with_the_config(directory, config):
    from ray.serve.schema import ServeDeploySchema

    serve_config = yaml.safe_load(ray_service(directory)["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve_config)  # what Serve's REST API accepts
    (app,) = serve_config["applications"]
    assert app["import_path"] == "raylane.deployments.app:build_app"  # the builder `raylane serve` runs
    expected = ClusterConfig.from_yaml(K8S / "configs" / f"{config}.yaml")
    # The gateway's own sections are its deployment's user config, so editing them restarts no pool.
    (gateway,) = [d for d in app["deployments"] if d["name"] == "Gateway"]
    assert not set(GATEWAY_SECTIONS) & set(app["args"])
    assert ClusterConfig.from_dict(app["args"]).with_sections(gateway["user_config"]["sections"]) == expected
    assert serve_config["http_options"] == {"host": "0.0.0.0", "port": expected.http.port}


def test_gpu_worker_groups_follow_the_pools():
    service = ray_service("k8s/overlays/gpu")
    cluster = service["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head["resources"]["limits"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    gpus = {
        n: g["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu")
        for n, g in groups.items()
    }
    assert gpus == {"gateway": None, "pool-coding": 4, "pool-reasoning": 4, "pool-chat": 1}
    chat = groups["pool-chat"]
    assert (chat["minReplicas"], chat["replicas"], chat["maxReplicas"]) == (2, 2, 8)
    assert cluster["enableInTreeAutoscaling"] is True
    assert service["spec"]["upgradeStrategy"] == {"type": "NewCluster"}
    assert cluster["gcsFaultToleranceOptions"]["redisAddress"] == "redis.raylane.svc:6379"
    # every pool's first bundle asks for the resource only its group's pods advertise
    (app,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    for deployment in app["deployments"]:
        if deployment["name"].startswith("ModelPool:"):
            pool = deployment["name"].split(":", 1)[1]
            resource = k8s.pool_resource(pool)
            assert deployment["placement_group_bundles"][0][resource] == 1
            assert groups[f"pool-{pool}"]["resources"] == {resource: "1"}
            bundle_gpus = sum(b.get("GPU", 0) for b in deployment["placement_group_bundles"])
            assert bundle_gpus == gpus[f"pool-{pool}"]
    # the checkpoints' PVC is mounted in every pod but the gateway's, the API-key Secret file in the
    # gateway's only (tests/reliability/test_k8s_exposure.py)
    for spec in [
        cluster["headGroupSpec"]["template"]["spec"],
        *(g["template"]["spec"] for g in groups.values()),
    ]:
        assert spec["securityContext"]["runAsNonRoot"] is True
        mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
        if spec is groups["gateway"]["template"]["spec"]:
            assert mounts["api-keys"] == "/etc/raylane/api-keys"
        else:
            assert mounts["models"] == "/models" and "api-keys" not in mounts


def test_network_policy_opens_only_the_http_port():
    policy = next(o for o in build(K8S / "base") if o["kind"] == "NetworkPolicy")
    open_ports, named_sources = set(), {}
    for rule in policy["spec"]["ingress"]:
        sources = rule.get("from")
        if not sources:  # from anywhere
            open_ports |= {p["port"] for p in rule["ports"]}
        elif all("podSelector" in s and "namespaceSelector" not in s for s in sources):
            assert sources == [{"podSelector": policy["spec"]["podSelector"]}]  # the cluster's own pods
        else:  # pods of one app in any namespace
            (source,) = sources
            app = source["podSelector"]["matchLabels"]["app.kubernetes.io/name"]
            named_sources[app] = [p["port"] for p in rule["ports"]]
    assert open_ports == {8000}
    # Prometheus scrapes the metrics port; the KubeRay operator deploys serveConfigV2 and submits jobs
    # through the dashboard.
    assert named_sources == {"prometheus": [k8s.METRICS_PORT], "kuberay-operator": [k8s.DASHBOARD_PORT]}


def test_pod_monitor_scrapes_every_ray_pod():
    objects = build(K8S / "base")
    monitor = next(o for o in objects if o["kind"] == "PodMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    cluster = ray_service("k8s/base")["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for template in templates:
        assert selector.items() <= template["metadata"]["labels"].items()
        ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
        assert ports[endpoint["port"]] == k8s.METRICS_PORT


def test_render_refuses_what_a_manifest_cannot_hold(tmp_path, capsys):
    from raylane.cluster.cli import main

    inline = yaml.safe_load((K8S / "configs" / "cpu-demo.yaml").read_text())
    inline["api_keys"] = {"keys": {"sk-secret": "premium"}}
    (tmp_path / "inline.yaml").write_text(yaml.safe_dump(inline))
    assert main(["k8s", "render", "--config", str(tmp_path / "inline.yaml")]) == 2
    assert "api_keys.keys" in capsys.readouterr().err
    outside = yaml.safe_load((K8S / "configs" / "gpu.yaml").read_text())
    outside["pools"][0]["model"] = "/data/elsewhere"
    (tmp_path / "outside.yaml").write_text(yaml.safe_dump(outside))
    assert main(["k8s", "render", "--config", str(tmp_path / "outside.yaml")]) == 2
    assert "pools[0] (coding).model" in capsys.readouterr().err
    haproxy = yaml.safe_load((K8S / "configs" / "cpu-demo.yaml").read_text())
    haproxy["http"] = {"ingress": "haproxy"}  # its probes and Service are the proxy's
    (tmp_path / "haproxy.yaml").write_text(yaml.safe_dump(haproxy))
    assert main(["k8s", "render", "--config", str(tmp_path / "haproxy.yaml")]) == 2
    assert "http.ingress" in capsys.readouterr().err


def test_render_refuses_to_give_the_public_demo_key_a_privileged_tier(tmp_path, capsys):
    from raylane.cluster.cli import main

    demo = yaml.safe_load((K8S / "configs" / "cpu-demo.yaml").read_text())
    demo["api_keys"]["default_tier"] = "premium"  # top priority, no rate limit
    (tmp_path / "demo.yaml").write_text(yaml.safe_dump(demo))
    argv = ["k8s", "render", "--config", str(tmp_path / "demo.yaml"), "--base", str(K8S / "base")]
    assert main([*argv, "--out", str(tmp_path / "out"), "--demo-secret"]) == 2
    assert "api_keys.default_tier: 'premium' is privileged" in capsys.readouterr().err
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0  # no public key: the tier is the config's


def test_an_incremental_upgrade_is_rendered_as_kuberay_takes_it(tmp_path, crd_schemas):
    """`--incremental-upgrade CLASS`: KubeRay's NewClusterWithIncrementalUpgrade through that Gateway
    API class, valid against the RayService CRD; without it, NewCluster."""
    args = k8s.parse_render_args(["--incremental-upgrade", "istio", "--out", str(tmp_path)], REPO)
    service = yaml.safe_load(k8s.render_files(args)["rayservice.yaml"])
    validate(service, crd_schemas)
    strategy = service["spec"]["upgradeStrategy"]
    assert strategy["type"] == "NewClusterWithIncrementalUpgrade"
    assert strategy["clusterUpgradeOptions"]["gatewayClassName"] == "istio"
    assert 0 < strategy["clusterUpgradeOptions"]["stepSizePercent"] <= 100
    assert ray_service("k8s/base")["spec"]["upgradeStrategy"] == {"type": "NewCluster"}
