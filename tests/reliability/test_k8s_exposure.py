"""The Kubernetes manifests expose the OpenAI port and nothing of Ray's: token authentication is on in
every RayService, and no Service, Ingress or open NetworkPolicy rule reaches GCS, the dashboard, the
Ray client or the metrics port. (The manifests as `kubectl kustomize` builds them; no API server
here, so what KubeRay creates from them is read off the fields that control it.)"""

import pytest

from raylane.cluster import k8s
from raylane.config import ClusterConfig
from tests.unit.test_k8s_render import KUSTOMIZE_DIRS, REPO, build

RAY_PORTS = {k8s.GCS_PORT, k8s.DASHBOARD_PORT, k8s.CLIENT_PORT, k8s.METRICS_PORT, k8s.AGENT_PORT}
HTTP_PORT = 8000


@pytest.fixture(params=KUSTOMIZE_DIRS)
def objects(request) -> list[dict]:
    return build(REPO / request.param)


def clusters(objects: list[dict]) -> list[dict]:
    return [o["spec"]["rayClusterConfig"] for o in objects if o["kind"] == "RayService"]


def containers(cluster: dict) -> list[dict]:
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


def test_ray_token_authentication_is_on(objects):
    assert clusters(objects)
    for cluster in clusters(objects):
        # KubeRay >= 1.5.1 then makes the token Secret and sets RAY_AUTH_MODE/RAY_AUTH_TOKEN everywhere.
        assert cluster["authOptions"]["mode"] == "token"
        assert not cluster["authOptions"].get("enableK8sTokenAuth")  # unsupported for RayService
        assert tuple(map(int, cluster["rayVersion"].split(".")[:2])) >= (2, 52)  # Ray's token auth
        for container in containers(cluster):  # nothing turns it back off
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            assert env.get("RAY_AUTH_MODE") in (None, "token"), container["name"]


def test_only_the_openai_port_is_exposed(objects):
    kinds = {o["kind"] for o in objects}
    assert "Ingress" not in kinds and "Route" not in kinds and "Gateway" not in kinds
    for service in (o for o in objects if o["kind"] == "Service"):
        assert {p["port"] for p in service["spec"]["ports"]} <= {HTTP_PORT}, service["metadata"]["name"]
    for rayservice in (o for o in objects if o["kind"] == "RayService"):
        serve = rayservice["spec"]["serveService"]
        assert [(p["port"], p["targetPort"]) for p in serve["spec"]["ports"]] == [(HTTP_PORT, HTTP_PORT)]
        assert serve["spec"].get("type", "ClusterIP") in ("ClusterIP", "LoadBalancer")
        cluster = rayservice["spec"]["rayClusterConfig"]
        head = cluster["headGroupSpec"]
        # The head Service KubeRay makes (GCS, dashboard, client for the workers) stays in the cluster.
        assert head.get("serviceType", "ClusterIP") == "ClusterIP" and not head.get("enableIngress")
        assert head.get("headService", {}).get("spec", {}).get("type", "ClusterIP") == "ClusterIP"
        for container in containers(cluster):  # no port of a pod is bound on its node
            assert not [p for p in container.get("ports", []) if "hostPort" in p], container["name"]
    for policy in (o for o in objects if o["kind"] == "NetworkPolicy"):
        for rule in policy["spec"]["ingress"]:
            if not rule.get("from"):  # open to every caller
                assert {p["port"] for p in rule["ports"]} == {HTTP_PORT}
            elif RAY_PORTS & {p["port"] for p in rule.get("ports", [])}:
                for source in rule["from"]:  # a Ray port: only for named apps' pods
                    assert source["podSelector"]["matchLabels"]["app.kubernetes.io/name"] in (
                        "prometheus",
                        "kuberay-operator",
                    )


# -- pod hardening and where the API keys go (#35) -------------------------------------------------


def groups(cluster: dict) -> list[tuple[str, dict]]:
    """(component, pod spec) of the head and every worker group."""
    pods = [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])]
    return [(p["metadata"]["labels"]["app.kubernetes.io/component"], p["spec"]) for p in pods]


def test_pods_run_read_only_and_without_a_service_account_token(objects):
    for cluster in clusters(objects):
        for component, pod in groups(cluster):
            # Only the head's autoscaler sidecar (KubeRay adds it when a pool autoscales) calls the API.
            needs_api = component == "head" and cluster["enableInTreeAutoscaling"]
            assert pod["automountServiceAccountToken"] is needs_api, component
            scratch = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
            for container in pod["containers"]:
                assert container["securityContext"]["readOnlyRootFilesystem"] is True, component
                writable = {m["mountPath"] for m in container["volumeMounts"] if m["name"] in scratch}
                # Ray's session dir and sockets, and the caches (demo checkpoints, router head).
                assert {"/tmp", "/home/ray/.cache", "/dev/shm"} <= writable, component
                env = {e["name"]: e.get("value") for e in container["env"]}
                assert env["RAYLANE_DEMO_DIR"].startswith("/home/ray/.cache/"), component


def secret_refs(container: dict, pod: dict, secret: str) -> set[str]:
    """The keys of `secret` that reach a container, as variables or mounted files."""
    refs = {
        e["valueFrom"]["secretKeyRef"]["key"]
        for e in container["env"]
        if e.get("valueFrom", {}).get("secretKeyRef", {}).get("name") == secret
    }
    mounted = {m["name"] for m in container["volumeMounts"]}
    for volume in pod["volumes"]:
        if volume["name"] in mounted and volume.get("secret", {}).get("secretName") == secret:
            refs |= {item["key"] for item in volume["secret"]["items"]}
    return refs


def test_api_keys_reach_only_the_gateway(objects):
    """Pool pods host the ranks and run model code: the keys file stays in the gateway's pods, and
    the head gets only the ops jobs' own key."""
    for cluster in clusters(objects):
        seen = {}
        for component, pod in groups(cluster):
            for container in pod["containers"]:
                seen.setdefault(component, set()).update(secret_refs(container, pod, "raylane-api-keys"))
        assert seen.pop("gateway") == {"keys"}
        assert seen.pop("head") == {"ops-key"}
        assert all(not refs for refs in seen.values()), seen


def test_no_public_demo_key_gets_a_privileged_tier():
    """A key written in a committed overlay is public. Its tier must be rate-limited in requests and
    tokens and below the top priority, so whoever reads the repository gets no more than anyone."""
    config = ClusterConfig.from_yaml(REPO / "k8s/configs/cpu-demo.yaml")
    top = min(t.priority for t in config.tiers)
    tiers = {t.name: t for t in config.tiers}
    found = 0
    for directory in KUSTOMIZE_DIRS:
        for secret in (o for o in build(REPO / directory) if o["kind"] == "Secret"):
            for line in secret["stringData"].get("keys", "").splitlines():
                key, tier = line.split()
                found += 1
                assert tier in tiers, line
                assert tiers[tier].priority > top, f"{directory}: {key} has the top-priority tier {tier}"
                assert tiers[tier].requests_per_minute and tiers[tier].tokens_per_minute, line
    assert found  # the cpu-demo overlay does publish one
