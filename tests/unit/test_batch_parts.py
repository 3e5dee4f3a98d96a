"""The Batch API's parts without Ray: reading an input file, the SQLite records, the order lines are
sent in, and the window of lines in flight."""

import asyncio
import json
import sqlite3

import pytest

from raylane.deployments.batch.lines import (
    LineCaps,
    error_line,
    output_record_text,
    read_input,
    read_line,
    record_text,
)
from raylane.deployments.batch.store import BatchStore
from raylane.deployments.batch.window import Window
from raylane.deployments.protocol.batch_answers import LineUsage
from tests.postgresql_server import postgresql_url  # noqa: F401  (a fixture)

CHAT = "/v1/chat/completions"


def line(custom_id, url=CHAT, method="POST", **body) -> dict:
    return {"custom_id": custom_id, "method": method, "url": url, "body": {"model": "m", **body}}


def jsonl(*items) -> bytes:
    return "\n".join(i if isinstance(i, str) else json.dumps(i) for i in items).encode()


def test_a_line_that_cannot_be_sent_is_set_aside_with_its_reason_and_the_rest_run():
    content = jsonl(
        line("a"),
        "not json",
        '["a list"]',
        line(""),
        line("b", method="GET"),
        line("c", url="/v1/images/generations"),
        {"custom_id": "d", "method": "POST", "url": CHAT, "body": "text"},
        line("e", stream=True),
        line("f", messages="x" * 200),
        line("g", url="/v1/completions", prompt="hi"),  # another endpoint than the first line's: served
    )
    read = read_input(content, max_lines=100, max_body_bytes=100)
    assert not read.errors
    lines = sorted(read.lines, key=lambda x: x.number)  # (they come in the order they are sent)
    assert [(x.custom_id, x.url) for x in lines] == [("a", CHAT), ("g", "/v1/completions")]
    assert [(n, custom_id, code) for n, custom_id, code, _ in read.rejected] == [
        (2, "", "invalid_json_line"),
        (3, "", "invalid_json_line"),
        (4, "", "invalid_custom_id"),
        (5, "b", "invalid_method"),
        (6, "c", "invalid_url"),
        (7, "d", "invalid_body"),
        (8, "e", "invalid_body"),
        (9, "f", "invalid_body"),
    ]


def test_a_file_that_cannot_be_run_whole_fails_naming_why():
    many = jsonl(*(line(str(i)) for i in range(5)))
    assert [(e["code"], e["line"]) for e in read_input(many, max_lines=3, max_body_bytes=1000).errors] == [
        ("too_many_lines", 4)
    ]
    twice = jsonl(line("a"), line("b"), line("a"))
    assert [(e["code"], e["line"]) for e in read_input(twice, 10, 1000).errors] == [
        ("duplicate_custom_id", 3)
    ]
    assert read_input(b"\xff\xfe", 10, 1000).errors[0]["code"] == "invalid_file"
    assert read_input(b"\n\n", 10, 1000).errors[0]["code"] == "empty_file"


def test_lines_sharing_a_prompt_prefix_are_sent_next_to_each_other():
    def ask(custom_id, system, user):
        return line(
            custom_id, messages=[{"role": "system", "content": system}, {"role": "user", "content": user}]
        )

    content = jsonl(ask("1", "You are A.", "x"), ask("2", "You are B.", "x"), ask("3", "You are A.", "y"))
    read = read_input(content, 10, 10_000)
    assert not read.errors and not read.rejected
    order = [x.custom_id for x in read.lines]  # in the order they are sent
    assert abs(order.index("1") - order.index("3")) == 1


def test_a_line_nested_100k_deep_or_holding_u2028_is_that_lines_own_business():
    """JSONL ends a line at "\n" only: U+2028 and its kin inside a string are text, and the line
    runs. A line nested past Python's recursion limit is that line's error; the others run."""
    nested = "[" * 100_000 + "]" * 100_000
    deep = f'{{"custom_id": "deep", "method": "POST", "url": "{CHAT}", "body": {{"x": {nested}}}}}'
    raw = line("sep", messages=[{"role": "user", "content": "a\u2028b\u2029c\x85d"}])
    separators = json.dumps(raw, ensure_ascii=False)  # the characters themselves, not escapes
    assert "\u2028" in separators
    read = read_input(jsonl(line("a"), deep, separators, line("z")), 10, 10**7)
    assert not read.errors
    assert sorted(x.custom_id for x in read.lines) == ["a", "sep", "z"]
    assert [(n, code) for n, _, code, _ in read.rejected] == [(2, "invalid_json_line")]


def test_a_line_asking_for_more_choices_or_tokens_than_a_batch_line_may_is_an_error_line():
    caps = LineCaps(max_body_bytes=10_000, max_n=4, max_tokens=100)
    content = jsonl(
        line("ok", n=4, max_tokens=100),
        line("n", n=5),
        line("prompts", url="/v1/completions", prompt=["a", "b", "c"], n=2),  # 6 sequences
        line("tokens", max_completion_tokens=101),
        line("output", url="/v1/responses", input="x", max_output_tokens=1000),
    )
    read = read_input(content, 10, 10_000, caps)
    assert [x.custom_id for x in read.lines] == ["ok"]
    rejected = {custom_id: (code, message) for _, custom_id, code, message in read.rejected}
    assert rejected["n"][0] == rejected["prompts"][0] == "too_many_choices"
    assert "batch.max_line_n" in rejected["prompts"][1]
    assert rejected["tokens"][0] == rejected["output"][0] == "max_tokens_too_large"
    assert "batch.max_line_tokens" in rejected["output"][1]


def test_a_line_that_sets_no_token_limit_gets_the_batch_lines_cap():
    """A line without max_tokens would generate up to the pool's context, past the cap that a line
    naming a limit is held to: it is sent with the cap as its limit."""
    caps = LineCaps(max_body_bytes=10_000, max_tokens=100)
    content = jsonl(
        line("chat"),
        line("chat-null", max_tokens=None, max_completion_tokens=None),
        line("chat-own", max_tokens=7),
        line("responses", url="/v1/responses", input="x"),
        line("completions-default", url="/v1/completions", prompt="x"),  # OpenAI's default: 16
        line("completions-null", url="/v1/completions", prompt="x", max_tokens=None),
        line("embeddings", url="/v1/embeddings", input="x"),
    )
    bodies = {}
    for number, raw in enumerate(content.decode().splitlines(), 1):
        sent, _ = read_line(raw, number, caps)
        bodies[sent.custom_id] = json.loads(sent.body)
    assert bodies["chat"]["max_completion_tokens"] == 100
    assert bodies["chat-null"]["max_completion_tokens"] == 100
    assert bodies["chat-own"]["max_tokens"] == 7 and "max_completion_tokens" not in bodies["chat-own"]
    assert bodies["responses"]["max_output_tokens"] == 100
    assert "max_tokens" not in bodies["completions-default"]
    assert bodies["completions-null"]["max_tokens"] == 100
    assert set(bodies["embeddings"]) == {"model", "input"}


def test_an_output_line_holding_unicode_line_separators_stays_one_line():
    text = record_text(error_line("x", "code", "one\u2028two\u2029three\x85four\nfive"))
    assert len(text.splitlines()) == 1 and json.loads(text)["error"]["message"].count("\u2028") == 1


def test_an_output_line_holds_the_gateways_body_as_json_on_one_line():
    body = {
        "object": "list",
        "data": [{"text": "a\u2028b\nc", "x": [0.1, -2e-05]}],
        "usage": {"prompt_tokens": 3},
    }
    for text in (json.dumps(body, ensure_ascii=False), json.dumps(body, indent=2)):  # however it was written
        line = output_record_text('id "1"', 200, text)
        assert len(line.splitlines()) == 1
        record = json.loads(line)
        assert record["custom_id"] == 'id "1"' and record["error"] is None
        assert record["response"]["status_code"] == 200 and record["response"]["body"] == body
        assert record["id"].startswith("batch_req_") and record["response"]["request_id"].startswith("req_")


def test_a_line_stored_by_an_earlier_version_is_counted_from_its_record(tmp_path):
    """Rows written before the store kept each line's tokens (a batch running across an upgrade)."""
    location = str(tmp_path / "b.sqlite3")
    BatchStore(location, tmp_path / "files", "app")  # makes the schema
    old = (
        '{"response": {"status_code": 200, "body": {"usage": {"prompt_tokens": 5, "completion_tokens": 2}}}}'
    )
    connection = sqlite3.connect(location)
    connection.execute(
        "INSERT INTO raylane_batch_lines (batch_id, line, status_code, record, bytes) VALUES (?, ?, ?, ?, ?)",
        ("b", 1, 200, old, len(old)),
    )
    connection.commit()
    store = BatchStore(location, tmp_path / "files", "app")
    store.finish_line("b", 2, 200, "{}", LineUsage(7, 1))
    assert [usage for *_, usage in store.results("b", 1, 2)] == [LineUsage(5, 2), LineUsage(7, 1)]


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    """The store on each of its databases (PostgreSQL: a real server, its database emptied for each
    test; a second app's rows beside this one's, which no query may see)."""
    if request.param == "sqlite":
        location = str(tmp_path / "b.sqlite3")
    else:
        location = request.getfixturevalue("postgresql_url")
        BatchStore(location, tmp_path / "x", "app").db.write(
            "TRUNCATE raylane_batches, raylane_batch_files, raylane_batch_lines, raylane_batch_outputs"
        )
    neighbour = BatchStore(location, tmp_path / "other", "other-app")
    neighbour.put_batch(batch("theirs"), "me", "k")
    neighbour.add_file(
        {
            "id": "their-file",
            "purpose": "batch",
            "filename": "x",
            "bytes": 1,
            "created_at": 1,
            "expires_at": 1,
        },
        "me",
        b"x",
    )
    return BatchStore(location, tmp_path / "files", "app")


def batch(batch_id: str, status: str = "in_progress") -> dict:
    return {"id": batch_id, "status": status, "created_at": 1}


def test_a_line_is_recorded_once(store):
    store.put_batch(batch("b"), "owner", "key")
    assert store.finish_line("b", 3, 200, '{"custom_id": "x"}')
    assert not store.finish_line("b", 3, 500, '{"custom_id": "x", "again": true}')
    assert store.finish_line("b", 4, 404, '{"custom_id": "y"}')
    assert store.done_lines("b") == {3, 4}
    assert store.line_counts("b") == (1, 1)
    assert [(n, code) for n, code, _, _ in store.results("b", 1, 10)] == [(3, 200), (4, 404)]
    assert store.line_bytes("b") == len('{"custom_id": "x"}') + len('{"custom_id": "y"}')


def test_batches_list_newest_first_per_owner_and_keep_their_place_when_updated(store):
    for name in "abcd":
        store.put_batch(batch(name), "me", "k")
    store.put_batch(batch("other"), "you", "k2")
    store.put_batch(batch("b", "completed"), "me", "k")  # an update keeps b's place
    assert [b["id"] for b in store.batches("me", 10, None)] == ["d", "c", "b", "a"]
    assert [b["id"] for b in store.batches("me", 2, "c")] == ["b", "a"]
    assert [row[0] for row in store.active("me")] == ["a", "c", "d"]
    assert store.batch("other", "me") is None and store.batch("other", "you")["id"] == "other"
    assert store.count_by_status() == {"in_progress": 4, "completed": 1}


def test_files_are_kept_per_owner_and_removed_with_their_bytes(store):
    for i, owner in enumerate(["me", "me", "you"]):
        record = {
            "id": f"f{i}",
            "purpose": "batch",
            "filename": "x",
            "bytes": 1,
            "created_at": 1,
            "expires_at": 10 + i,
        }
        store.add_file(record, owner, b"x")
    assert [f["id"] for f in store.files("me", None, 10, None, desc=False)] == ["f0", "f1"]
    assert [f["id"] for f in store.files("me", "batch", 10, "f1", desc=True)] == ["f0"]
    assert store.file("f2", "me") is None and store.file_usage("me") == (2, 2)
    assert store.expired_files(11) == [("f0", "me"), ("f1", "me")]
    assert store.delete_file("f0", "me") and not store.path_of("f0").exists()
    assert not store.delete_file("f2", "me") and store.path_of("f2").exists()


def test_the_window_grows_while_pools_are_idle_and_halves_when_busy():
    async def run() -> list[int]:
        window = Window(limit=6)
        sizes = []
        for idle in [True] * 20 + [False, False, False, False]:
            await window.acquire()
            await window.release(idle)
            sizes.append(int(window.size))
        return sizes

    sizes = asyncio.run(run())
    assert sizes[0] == 2 and max(sizes) == 6 and sizes[19] == 6
    assert sizes[20:] == [3, 1, 1, 1]
