"""A pool of the simulated engine (`model: sim:llama-3.1-8b-h100`) in the session's Serve app, through
the gateway with the `openai` SDK: the control plane serves it as any pool, and its replica holds no
torch."""

from pathlib import Path

HELLO = [{"role": "user", "content": "Write one sentence about the sea."}]


def test_sim_pool_answers_through_the_gateway(client):
    whole = client.chat.completions.create(model="sim", messages=HELLO, max_tokens=16)
    again = client.chat.completions.create(model="sim", messages=HELLO, max_tokens=16)
    stream = client.chat.completions.create(
        model="sim", messages=HELLO, max_tokens=16, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    text = whole.choices[0].message.content
    assert text.strip() and text == again.choices[0].message.content == streamed  # from the prompt alone
    assert whole.usage.completion_tokens == chunks[-1].usage.completion_tokens == 16
    assert client.completions.create(model="sim", prompt="Hello", max_tokens=3).usage.completion_tokens == 3


def test_sim_replica_imports_no_torch(api_server, client):
    client.chat.completions.create(model="sim", messages=HELLO, max_tokens=2)
    stats = api_server.pool_stats("sim")
    maps = Path(f"/proc/{stats['pid']}/maps").read_text()
    assert "torch" not in maps and "libtorch" not in maps
    rollup = Path(f"/proc/{stats['pid']}/smaps_rollup").read_text()
    pss_kb = next(int(line.split()[1]) for line in rollup.splitlines() if line.startswith("Pss:"))
    print(f"sim pool replica pid {stats['pid']}: PSS {pss_kb / 1024:.0f} MiB")
