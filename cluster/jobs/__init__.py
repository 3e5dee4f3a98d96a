"""Operations jobs, each runnable on the cluster with `ray job submit`:

    ray job submit --address http://HEAD:8265 --working-dir . -- python -m raylane.cluster.jobs.smoke
    ray job submit ... -- python -m raylane.cluster.jobs.warmup --system-prompts prompts.yaml
    ray job submit ... -- python -m raylane.cluster.jobs.bench --model chat --num-prompts 64
    ray job submit ... -- python -m raylane.cluster.jobs.route_eval --min-accuracy 0.85

They talk to the deployed app over HTTP (`--url`, default the node's own Serve proxy) and read the
deployed `ClusterConfig` from Serve (or `--config FILE`). Each exits non-zero when its check fails,
so the job (and a KubeRay `RayJob`) fails with it. k8s/RUNBOOK.md says when to run which.
"""
