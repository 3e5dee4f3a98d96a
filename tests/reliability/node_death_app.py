"""Deploys the node-death test's app on the Ray cluster at $RAY_ADDRESS and exits (Serve keeps it):
each pool and the gateway pinned by a custom resource that only its node advertises, as the KubeRay
worker groups pin them: pool `primary` to the worker node, pool `backup` and the gateway to the head.

    python -m tests.reliability.node_death_app CONFIG_JSON
"""

import json
import sys

from ray import serve

from raylane.cluster.k8s import GATEWAY_RESOURCE, pool_resource
from raylane.config import ClusterConfig
from raylane.deployments.app import APP_NAME, gateway_deployment_options, pool_deployment_options
from raylane.deployments.gateway.ingress import Gateway
from raylane.deployments.pool.model_pool import ModelPool


def main() -> None:
    config = ClusterConfig.from_dict(json.loads(sys.argv[1]))
    pools = {}
    for pool in config.pools:
        options = pool_deployment_options(pool)
        options["placement_group_bundles"][0][pool_resource(pool.name)] = 1
        pools[pool.name] = serve.deployment(ModelPool, **options).bind(pool)
    # Unpinned, the gateway could land on the worker and die with it (the proxy then answers 500).
    options = gateway_deployment_options(config)
    options["ray_actor_options"]["resources"] = {GATEWAY_RESOURCE: 1}
    gateway = serve.deployment(Gateway, **options).bind(config, pools)
    # Both nodes share this machine's address: one HTTP proxy, on the head (the cluster's entry point,
    # as a Kubernetes Service in front of the head would be).
    serve.start(proxy_location="HeadOnly", http_options={"host": config.http.host, "port": config.http.port})
    serve.run(gateway, name=APP_NAME, route_prefix="/")


if __name__ == "__main__":
    main()
