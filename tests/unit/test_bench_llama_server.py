"""`raylane bench compare --llama-server-a/-b`: the arguments, the cached build's paths, and the
llama-server side end to end against a stand-in binary (a small stdlib HTTP server that answers like
llama-server and records its command line and request bodies). No test builds or runs llama.cpp."""

import argparse
import json
import socket
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from raylane.bench import compare, llama_server
from raylane.bench.client import RequestOptions, chat_stream_args
from raylane.bench.datasets import BenchRequest
from raylane.bench.llama_server import LlamaServer, LlamaServerError

# Answers /health with 503 twice (a model loading), then 200; streams `max_tokens` tokens with a final
# usage chunk, or stops after 2 (an EOS) unless the body asks for `ignore_eos`. Writes its argv and
# every request body to $FAKE_LLAMA_LOG/<port>.json. Holds 4 KiB of memory per token of context (`-c`),
# as a KV cache would.
FAKE_LLAMA_SERVER = textwrap.dedent(
    """
    import argparse, json, os, sys, threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    parser = argparse.ArgumentParser()
    for flag in ("-m", "-np", "-t", "-c", "--host", "--port"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--no-repack", action="store_true")
    args = parser.parse_args()
    log = os.path.join(os.environ["FAKE_LLAMA_LOG"], args.port + ".json")
    state = {"argv": sys.argv[1:], "bodies": [], "health_polls": 0}
    kv_cache = b"x" * (int(args.c) * 4096)  # written, so resident

    lock = threading.Lock()

    def save():  # requests run in threads: one writer at a time, and the file always whole
        with lock:
            with open(log + ".tmp", "w") as f:
                json.dump(state, f)
            os.replace(log + ".tmp", log)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            with lock:
                state["health_polls"] += 1
            save()
            self.send_response(200 if self.path == "/health" and state["health_polls"] > 2 else 503)
            self.end_headers()
            self.wfile.write(b"{}")

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                state["bodies"].append(body)
            save()
            n = body["max_tokens"] if body.get("ignore_eos") else min(2, body["max_tokens"])
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            base = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": body["model"]}
            for i in range(n):
                choice = {"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}
                self.wfile.write(b"data: " + json.dumps(base | {"choices": [choice]}).encode() + b"\\n\\n")
            usage = {"prompt_tokens": 9, "completion_tokens": n, "total_tokens": 9 + n}
            last = base | {"choices": [], "usage": usage}
            self.wfile.write(b"data: " + json.dumps(last).encode() + b"\\n\\n")
            self.wfile.write(b"data: [DONE]\\n\\n")

    save()
    ThreadingHTTPServer((args.host, int(args.port)), Handler).serve_forever()
    """
)


@pytest.fixture
def fake_binary(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """(the stand-in llama-server, the folder where each instance writes what it saw)."""
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!{sys.executable}\n{FAKE_LLAMA_SERVER}")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    logs = tmp_path / "seen"
    logs.mkdir()
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(logs))
    monkeypatch.setenv("RAYLANE_LLAMA_CPP_DIR", str(tmp_path / "cache"))  # its server logs go there
    return binary, logs


@pytest.fixture
def gguf(tmp_path) -> Path:
    path = tmp_path / "tiny.Q4_1.gguf"
    path.write_bytes(b"GGUF")  # only the stand-in reads it, and it does not
    return path


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    return parser.parse_args(argv)


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


# ---------------------------------------------------------------- arguments and the endpoint source


def test_llama_server_side_takes_the_gguf_and_server_settings(gguf):
    args = parse(["--config-a", "raylane.yaml", "--llama-server-b", str(gguf), "--llama-server-threads", "4"])
    assert args.llama_server_b == gguf and args.llama_server_a is None
    source = compare.llama_server_source(args, "b", gguf)
    assert (source.label, source.model) == ("llama-server", "tiny.Q4_1.gguf")
    server = source.server
    assert (server.model, server.n_parallel, server.threads) == (gguf, 16, 4)
    server.port = 5555
    cmd = server.command()
    assert cmd[1:9] == ["-m", str(gguf), "-np", "16", "-t", "4", "-c", str(16 * 2048)]
    assert cmd[-4:] == ["--host", "127.0.0.1", "--port", "5555"]
    # Extra arguments reach the server (e.g. --no-repack where llama.cpp's AMX kernels crash).
    args = parse(
        ["--llama-server-a", str(gguf), "--config-b", "raylane.yaml"]
        + ["--llama-server-arg=--no-repack", "--llama-server-arg=-fa"]
    )
    server = compare.llama_server_source(args, "a", gguf).server
    server.port = 5555
    assert server.command()[9:11] == ["--no-repack", "-fa"]


def test_a_side_is_one_of_url_config_or_llama_server(gguf, capsys):
    with pytest.raises(SystemExit):
        parse(["--base-url-a", "http://x/v1", "--base-url-b", "http://y/v1", "--llama-server-b", str(gguf)])
    assert "not allowed with argument" in capsys.readouterr().err
    args = parse(["--llama-server-a", str(gguf), "--base-url-b", "http://y/v1", "--model", "chat"])
    args.label_a = "llama.cpp"
    assert compare.llama_server_source(args, "a", gguf).label == "llama.cpp"
    assert compare.llama_server_source(args, "a", gguf).model == "chat"  # --model applies to both


def test_both_sides_are_asked_for_exactly_max_tokens():
    """raylane reads `ignore_eos`; llama-server reads the same field, and `max_tokens` as n_predict."""
    request = BenchRequest([{"role": "user", "content": "What is the capital of France?"}], 7, 128)
    body = chat_stream_args("chat", request, RequestOptions())
    assert body["max_tokens"] == 128 and body["temperature"] == 0.0
    assert body["extra_body"] == {"ignore_eos": True}
    assert body["messages"] == request.messages
    assert chat_stream_args("chat", request, RequestOptions(ignore_eos=False))["extra_body"] is None


# ---------------------------------------------------------------- the cached build


def test_build_is_found_in_the_cache_and_not_repeated(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYLANE_LLAMA_CPP_DIR", str(tmp_path))
    cached = tmp_path / "9.9.9" / "bin" / "llama-server"
    assert llama_server.binary_path("9.9.9") == cached
    cached.parent.mkdir(parents=True)
    cached.write_text("built")

    def no_build(*a, **k):
        raise AssertionError("a cached binary must not be rebuilt")

    monkeypatch.setattr(llama_server, "download_sdist", no_build)
    assert llama_server.ensure_built("9.9.9") == cached


def test_build_commands_make_only_the_server_release_cpu_without_downloads(tmp_path):
    configure, build = llama_server.build_commands(tmp_path / "src", tmp_path / "build", jobs=2)
    for flag in (
        "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_CURL=OFF",
        "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=ON",
    ):
        assert flag in configure
    assert "-DLLAMA_USE_PREBUILT_UI=OFF" in configure  # it would download the web UI at configure time
    assert build[-3:] == ["--target", "llama-server", "-j2"]
    assert configure[:3] == build[:3] == ["nice", "-n", "10"]


def test_missing_gguf_is_named_before_anything_starts(tmp_path, fake_binary):
    binary, logs = fake_binary
    with pytest.raises(LlamaServerError, match="no such GGUF"):
        LlamaServer(tmp_path / "absent.gguf", binary=binary).start()
    assert list(logs.iterdir()) == []


# ---------------------------------------------------------------- end to end against the stand-in


def run_compare(argv: list[str]) -> int:
    from raylane.cluster.cli import main

    return main(["bench", "compare", *argv])


def table_rows(out: str, metric: str) -> list[list[str]]:
    """The A and B cells of every printed table row of `metric`."""
    rows = [
        [c.strip() for c in line.strip("|").split("|")] for line in out.splitlines() if line.startswith("|")
    ]
    return [row[1:3] for row in rows if row[0] == metric]


def seen(logs: Path) -> list[dict]:
    """What each stand-in saw (in port order; the assertions on them hold for either side)."""
    return [json.loads(p.read_text()) for p in sorted(logs.glob("*.json"))]


def test_compare_starts_llama_server_sides_sends_the_same_requests_and_stops_them(
    fake_binary, gguf, tmp_path, capsys
):
    binary, logs = fake_binary
    argv = ["--llama-server-a", str(gguf), "--llama-server-b", str(gguf), "--label-b", "other"]
    argv += ["--llama-server-bin", str(binary), "--llama-server-ctx-per-slot", "512", "--model", "chat"]
    argv += ["--num-prompts", "4", "--random-output-len", "5", "--random-range-ratio", "0.5"]
    argv += ["--concurrency", "1,4", "--repeats", "1", "--no-progress", "--out", str(tmp_path)]
    argv += ["--llama-server-arg=--no-repack"]
    assert run_compare(argv) == 0
    out = capsys.readouterr().out
    side_a, side_b = seen(logs)
    for side in (side_a, side_b):
        assert side["argv"][:8] == ["-m", str(gguf), "-np", "16", "-t", "2", "-c", str(16 * 512)]
        assert side["health_polls"] >= 3  # it waited through the 503s of a loading model
        assert not listening(int(side["argv"][-1]))  # stopped on exit
        assert all(b["ignore_eos"] is True and b["model"] == "chat" for b in side["bodies"])
    # The same workload on both sides: one warm-up, then 4 requests per sweep point.
    assert len(side_a["bodies"]) == len(side_b["bodies"]) == 1 + 2 * 4

    def workload(side):  # at concurrency 4 the arrival order varies
        return sorted(json.dumps([b["messages"], b["max_tokens"]]) for b in side["bodies"])

    assert workload(side_a) == workload(side_b)
    assert len({b["max_tokens"] for b in side_a["bodies"]}) > 1  # lengths vary, yet each is exact:
    report = json.loads((tmp_path / "compare.json").read_text())
    for point in report["points"]:
        assert point["exact_output_tokens"] == [{"exact": 4, "completed": 4}] * 2
    assert table_rows(out, "exactly max_tokens") == [["4/4", "4/4"]] * 2
    assert [e["label"] for e in report["endpoints"]] == ["llama-server", "other"]
    # How each server ran is on record, its extra argument included.
    commands = sorted(e["command"][1:] for e in report["endpoints"])
    assert commands == sorted([side_a["argv"], side_b["argv"]])
    assert all("--no-repack" in command for command in commands)
    # Each server's memory, read after every run: its own process, the 32 MiB it holds and an
    # interpreter's worth more (the client's own process, this one, counts nowhere).
    for point in report["points"]:
        assert all(32 <= mib <= 32 + 40 for mib in point["memory_mib"]["sides"]), point["memory_mib"]
        assert list(point["memory_mib"]["processes"]) == ["llama-server"]  # both, by their name
    assert len(table_rows(out, "memory PSS MiB")) == 2


def test_compare_shows_a_side_that_stops_before_max_tokens(fake_binary, gguf, tmp_path, capsys):
    binary, _ = fake_binary
    argv = ["--llama-server-a", str(gguf), "--llama-server-b", str(gguf), "--llama-server-bin", str(binary)]
    argv += ["--num-prompts", "3", "--random-output-len", "6", "--random-range-ratio", "0"]
    argv += ["--concurrency", "2", "--repeats", "1", "--no-progress", "--no-ignore-eos"]
    assert run_compare(argv) == 0
    out = capsys.readouterr().out
    assert table_rows(out, "exactly max_tokens") == [["0/3", "0/3"]]
    assert "ended 3 answers off max_tokens" in out


def test_a_server_that_exits_at_start_is_reported_with_its_log(tmp_path, gguf, capsys, monkeypatch):
    monkeypatch.setenv("RAYLANE_LLAMA_CPP_DIR", str(tmp_path / "cache"))
    binary = tmp_path / "broken-server"
    binary.write_text("#!/bin/sh\necho 'error: unknown argument' >&2\nexit 3\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    argv = ["--llama-server-a", str(gguf), "--base-url-b", "http://127.0.0.1:9/v1", "--model", "m"]
    assert run_compare([*argv, "--llama-server-bin", str(binary), "--num-prompts", "1", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "llama-server exited with 3" in err
    log = Path(err.split("see ")[-1].strip())
    assert "unknown argument" in log.read_text()
    assert log.parent == tmp_path / "cache" / "logs"


def test_a_packaged_model_name_stands_for_its_gguf_file(tmp_path):
    path = compare.gguf_file(Path("smollm2-135m-instruct"))
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert compare.gguf_file(tmp_path / "mine.gguf") == tmp_path / "mine.gguf"  # a path stays a path
