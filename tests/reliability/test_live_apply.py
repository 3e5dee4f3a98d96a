"""`raylane apply` changes a running cluster under load, and nobody notices.

App: pools `chat` (two replicas) and `extra`, keys on the `premium` and `standard` tiers, one route;
`chat` and the pool added later are simulated (engine/sim/: what is changed is pools and replicas,
not a model's words, and six replica starts cost a fraction of a model's), `extra` runs the tiny llama
(a structured answer, constrained by a grammar the simulator does not run).
Four streaming clients (two per key) and an `auto` client run throughout, while four configs are
applied in turn (cluster/apply.py): (a) a tier's rate limit, a new API key and the gateway's grammar
check bound, (b) a new pool and a route to it, (c) an engine setting of `chat` (a rolling restart of
its two replicas), (d) `extra` removed. Then a change that cannot start (a broken checkpoint) is
rolled back, and the command line refuses a missing checkpoint and prints a dry run. Asserted: no
client request fails, no stream is cut, the pools no change names keep their replica actors, and
each change shows where a user would see it.
"""

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx2
import openai
import pytest
import yaml

from tests.live_servers import wait_healthy
from tests.reliability.conftest import forked_workers, llama_pool, replica_names, sim_pool

APP = "rel-live-apply"
KEYS = {"premium": "key-a-premium", "standard": "key-b-standard"}
NEW_KEY = "key-c-trial"
REQUEST_ID_PREFIX = "live-apply-"
pytestmark = pytest.mark.timeout(900)


def tiers(trial_rpm: int) -> list[dict]:
    return [
        {"name": "premium", "priority": 0},
        {"name": "standard", "priority": 1, "requests_per_minute": 100_000},
        {"name": "trial", "priority": 2, "requests_per_minute": trial_rpm},
    ]


def base_config(demo_models, port: int) -> dict:
    two = {"min_replicas": 2, "max_replicas": 2}
    return {
        "http": {"host": "127.0.0.1", "port": port},
        "gateway": {"num_cpus": 0.1, "pool_health_period_s": 1.0},
        "embeddings": {"enabled": False},
        "tiers": tiers(trial_rpm=1000),
        "api_keys": {"keys": {KEYS["premium"]: "premium", KEYS["standard"]: "standard"}},
        "pools": [
            sim_pool("chat", replicas=two, engine={"max_num_seqs": 16}),
            llama_pool(demo_models, "extra", engine={"engine_core": "thread"}),
        ],
        "router": {"routes": [{"name": "chat", "pool": "chat"}]},
    }


class Load:
    """Clients that keep sending until stopped; every request's outcome is kept."""

    def __init__(self, url: str) -> None:
        self.url, self.stop = url, threading.Event()
        self.outcomes: list[str] = []
        self.threads = [
            threading.Thread(target=self._stream, args=(key,)) for key in KEYS.values() for _ in range(2)
        ]  # (four a key kept the two cores so busy that each pool start took 45-55 s, not ~15)
        self.threads.append(threading.Thread(target=self._auto))

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=120)

    def _stream(self, key: str) -> None:
        client = self.client(key)
        while not self.stop.is_set():
            try:
                chunks = client.chat.completions.create(
                    model="chat",
                    messages=[{"role": "user", "content": "Tell me about the sea."}],
                    max_tokens=24,
                    stream=True,
                    extra_headers={"x-request-id": f"{REQUEST_ID_PREFIX}{uuid.uuid4().hex}"},
                )
                finish = [
                    c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
                ]
                self.outcomes.append("ok" if finish else "cut: no finish_reason")
            except openai.OpenAIError as e:
                self.outcomes.append(f"{type(e).__name__}: {e}"[:300])

    def _auto(self) -> None:
        client = self.client(KEYS["premium"])
        prompts = ["Write a Python function that reverses a list.", "How was your weekend?"]
        i = 0
        while not self.stop.is_set():
            try:
                client.chat.completions.create(
                    model="auto", messages=[{"role": "user", "content": prompts[i % 2]}], max_tokens=8
                )
                self.outcomes.append("ok")
            except openai.OpenAIError as e:
                self.outcomes.append(f"auto {type(e).__name__}: {e}"[:300])
            i += 1

    def failures(self) -> list[str]:
        return [o for o in self.outcomes if o != "ok"]


def actors() -> dict[str, set[str]]:
    return {
        d: set(replica_names(APP, d))
        for d in ("Gateway", "ModelPool:chat", "ModelPool:extra", "ModelPool:fresh")
    }


def test_apply_changes_a_cluster_under_load_without_a_failed_request(api_server, demo_models, tmp_path):
    from ray import serve

    from raylane.cluster.apply import ApplyError, apply_config, deploy_live
    from raylane.config import ClusterConfig
    from raylane.deployments import live_config
    from raylane.deployments.app import delete_app

    port = int(api_server.url.rsplit(":", 1)[1])
    url = f"{api_server.url}/{APP}"
    config = base_config(demo_models, port)
    deploy_live(ClusterConfig.from_dict(config), APP, f"/{APP}")
    steps: dict[str, float] = {}
    try:
        wait_healthy(f"{url}/health", 300)
        with Load(url) as load:
            time.sleep(3)  # the clients are streaming
            before = actors()
            chat = openai.OpenAI(base_url=f"{url}/v1", api_key=NEW_KEY, max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                chat.models.list()

            premium = openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS["premium"], max_retries=0)
            _structured(premium)  # the gateway checks its schema in a grammar worker
            assert forked_workers(APP, "Gateway") == 1

            # (a) A tier's rate limit, a new key and the grammar check's bound: in place on the gateway.
            config["tiers"] = tiers(trial_rpm=2)
            config["api_keys"]["keys"][NEW_KEY] = "trial"
            config["gateway"]["grammar_check_timeout_s"] = 4.0
            started = time.monotonic()
            plan = apply_config(ClusterConfig.from_dict(config), APP, timeout_s=300)
            steps["a_keys_and_limits"] = time.monotonic() - started
            assert plan.in_place and not (plan.added or plan.rolled or plan.removed), plan
            codes = [_status(chat, "chat") for _ in range(3)]
            assert codes == [200, 200, 429], codes  # the new key works, at the new tier's 2 requests/min
            assert actors() == before
            _structured(premium)  # the running worker takes the new bound; none is left idle beside it
            assert forked_workers(APP, "Gateway") == 1

            # (b) A new pool and a route to it.
            config["pools"].append(sim_pool("fresh"))
            config["router"]["routes"].append({"name": "coding", "pool": "fresh"})
            started = time.monotonic()
            plan = apply_config(ClusterConfig.from_dict(config), APP, timeout_s=300)
            steps["b_new_pool_and_route"] = time.monotonic() - started
            assert plan.added == ["fresh"], plan
            reply = premium.chat.completions.with_raw_response.create(
                model="auto",
                messages=[{"role": "user", "content": "Write a Python function that parses a CSV file."}],
                max_tokens=8,
            )
            assert reply.headers["x-raylane-pool"] == "fresh", dict(reply.headers)
            after_b = actors()
            assert {d: after_b[d] for d in before if d != "ModelPool:fresh"} == {
                d: before[d] for d in before if d != "ModelPool:fresh"
            }

            # (c) An engine setting of `chat` (two replicas): rolled a replica at a time.
            config["pools"][0]["engine"] = {**config["pools"][0]["engine"], "num_kv_blocks": 96}
            started = time.monotonic()
            plan = apply_config(ClusterConfig.from_dict(config), APP, timeout_s=400)
            steps["c_rolling_restart"] = time.monotonic() - started
            assert list(plan.rolled) == ["chat"], plan
            after_c = actors()
            assert len(after_c["ModelPool:chat"]) == 2 and not (
                after_c["ModelPool:chat"] & before["ModelPool:chat"]
            )
            for d in ("Gateway", "ModelPool:extra", "ModelPool:fresh"):
                assert after_c[d] == after_b[d], d
            handle = serve.get_deployment_handle("ModelPool:chat", app_name=APP)
            blocks = {handle.stats.remote().result(timeout_s=30)["num_kv_blocks"] for _ in range(8)}
            assert blocks == {96}, blocks

            # (d) `extra` removed: no new request reaches it, then it stops.
            del config["pools"][1]
            started = time.monotonic()
            plan = apply_config(ClusterConfig.from_dict(config), APP, timeout_s=300)
            steps["d_remove_pool"] = time.monotonic() - started
            assert plan.removed == ["extra"], plan
            with pytest.raises(openai.NotFoundError):
                premium.chat.completions.create(model="extra", messages=[{"role": "user", "content": "hi"}])
            for d in ("Gateway", "ModelPool:chat", "ModelPool:fresh"):
                assert actors()[d] == after_c[d], d

            # A change whose replicas cannot start: rolled back, the old replicas serve throughout.
            broken = tmp_path / "broken-checkpoint"
            broken.mkdir()
            (broken / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
            bad = json.loads(json.dumps(config))
            bad["pools"][0]["model"] = str(broken)
            generation = live_config.read_state(APP).generation
            started = time.monotonic()
            with pytest.raises(ApplyError, match="pool chat"):
                apply_config(ClusterConfig.from_dict(bad), APP, timeout_s=150)
            steps["rolled_back"] = time.monotonic() - started
            assert actors()["ModelPool:chat"] == after_c["ModelPool:chat"]
            assert live_config.read_state(APP).generation == generation

            # The command line: a checkpoint that is not there changes nothing, and names the field.
            env = os.environ | {"RAY_ADDRESS": _ray_address()}
            raylane = str(Path(sys.executable).with_name("raylane"))
            bad["pools"][0]["model"] = str(tmp_path / "nowhere")
            (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
            done = subprocess.run(
                [raylane, "apply", "--app", APP, "--config", str(tmp_path / "bad.yaml")],
                env=env, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert done.returncode == 2 and "pools[0] (chat).model" in done.stderr, done.stdout + done.stderr
            # A dry run prints the plan and changes nothing.
            dry = json.loads(json.dumps(config))
            dry["pools"][0]["engine"]["num_kv_blocks"] = 80
            (tmp_path / "dry.yaml").write_text(yaml.safe_dump(dry))
            done = subprocess.run(
                [raylane, "apply", "--app", APP, "--dry-run", "--config", str(tmp_path / "dry.yaml")],
                env=env, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert done.returncode == 0, done.stdout + done.stderr
            assert "pool chat: rolling restart, one replica at a time (engine.num_kv_blocks)" in done.stdout
            assert actors()["ModelPool:chat"] == after_c["ModelPool:chat"]
            assert live_config.read_state(APP).generation == generation

            # What an operator reads: the generation in `raylane status` and the metrics.
            from raylane.cluster.status import collect

            assert collect(APP)[1]["config_generation"] == generation == 5
            premium = {"Authorization": f"Bearer {KEYS['premium']}"}
            metrics = httpx2.get(f"{url}/metrics", headers=premium, timeout=30).text
            assert 'raylane_config_applies_total{result="applied"} 4.0' in metrics, metrics[-3000:]
            assert 'raylane_config_applies_total{result="rolled_back"} 1.0' in metrics
            assert "raylane_config_generation{" in metrics
            time.sleep(2)
        failures = load.failures()
        print(f"\nlive apply: {len(load.outcomes)} requests, {len(failures)} failed, steps (s): {steps}")
        assert not failures, failures[:10]
        assert len(load.outcomes) > 50
        # Each request's log line names the config that served it: every generation served some.
        assert logged_generations() == {1, 2, 3, 4, 5}
    finally:
        delete_app(APP)


def logged_generations() -> set[int]:
    import ray

    folder = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs" / "serve"
    seen = set()
    for path in folder.glob("raylane_requests_*.jsonl"):
        for line in path.read_text().splitlines():
            if REQUEST_ID_PREFIX in line:
                seen.add(json.loads(line)["config_generation"])
    return seen


def _status(client: openai.OpenAI, model: str) -> int:
    try:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        return 200
    except openai.APIStatusError as e:
        return e.status_code


def _structured(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"sea": {"type": "string"}}, "required": ["sea"]}
    reply = client.chat.completions.create(
        model="extra",
        messages=[{"role": "user", "content": "Describe the sea."}],
        response_format={"type": "json_schema", "json_schema": {"name": "sea", "schema": schema}},
        max_tokens=4,
    )
    assert reply.choices[0].finish_reason == "length", reply


def _ray_address() -> str:
    import ray

    return ray.get_runtime_context().gcs_address
