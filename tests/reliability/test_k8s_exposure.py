"""The Kubernetes manifests expose the OpenAI port and nothing of Ray's: token authentication is on in
every RayService, and no Service, Ingress or open NetworkPolicy rule reaches GCS, the dashboard, the
Ray client or the metrics port. (The manifests as `kubectl kustomize` builds them; no API server
here, so what KubeRay creates from them is read off the fields that control it.)"""

import pytest

from cluster import k8s
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
