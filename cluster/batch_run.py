"""`raylane batch run`: a batch file too big for the online queue, run on the Ray cluster with Ray
Data, through the running app's gateway as the `batch` tier (the lowest: it takes what interactive
traffic leaves idle, as `/v1/batches` does).

    raylane batch run prompts.jsonl --output answers.jsonl
    ray job submit --address http://head:8265 -- raylane batch run s3://bucket/in.jsonl --output out.jsonl

Input lines are OpenAI's batch lines (`custom_id`, `method`, `url`, `body`); the output gets one
line per input line in OpenAI's output format (a line the gateway refused carries its status and
error body; a line that could not be read, `error`). Ray Data reads the input (a local path, or any
filesystem `pyarrow` reads: s3://, gs://, ...) in blocks and sends each block of lines to one of
`--actors` actors, each keeping `--concurrency` lines in flight on the gateway; this process appends
results to the output as they come. Run again on the same output, it sends only the lines whose
`custom_id` is not in it yet: an interrupted run resumes where it stopped, and no line is twice.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

RETRY_S = (1.0, 30.0)  # a line turned away for load waits this long (doubling) before its next try


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="batch_command", required=True)
    run = sub.add_parser("run", help="run a batch file (OpenAI's JSONL) on the cluster with Ray Data")
    run.add_argument("input", help="the input JSONL (a path, or a URI Ray Data reads: s3://...)")
    run.add_argument("--output", required=True, help="the output JSONL (appended to; resumes a run)")
    run.add_argument("--address", default=None, help="Ray cluster (default: $RAY_ADDRESS, else local)")
    run.add_argument("--app", default="raylane", help="Serve application name (default raylane)")
    run.add_argument("--key-id", default="batch-job", help="whom the lines are served for (fair shares)")
    run.add_argument("--actors", type=int, default=2, help="Ray Data actors sending lines (default 2)")
    run.add_argument("--concurrency", type=int, default=4, help="lines in flight per actor (default 4)")
    run.add_argument("--retries", type=int, default=20, help="tries of a line turned away for load")


class LineSender:
    """A Ray Data actor: sends a block of input lines to the app's gateway, `concurrency` at a time,
    each tried again (waiting, doubling) while the gateway turns it away for load (429/503). Async,
    as a Serve handle is used from an event loop."""

    def __init__(self, app: str, key_id: str, concurrency: int, retries: int) -> None:
        self.app, self.key_id, self.retries = app, key_id, retries
        self.concurrency = concurrency
        self.gateway = None

    async def __call__(self, block: dict):
        from raylane.deployments.batch.lines import error_line, read_line

        if self.gateway is None:
            from ray import serve

            self.gateway = serve.get_deployment_handle("Gateway", self.app)
        records: list[str] = []
        lines = []
        for text in block["text"]:
            line, (custom_id, code, message) = read_line(str(text), 0, 2**30)
            if line is None:
                records.append(json.dumps(error_line(custom_id, code, message)))
            else:
                lines.append(line)
        limit = asyncio.Semaphore(self.concurrency)
        records += await asyncio.gather(*(self._send(line, limit) for line in lines))
        yield {"record": records}

    async def _send(self, line, limit: asyncio.Semaphore) -> str:
        from raylane.deployments.batch.lines import output_record_text

        wait_s = RETRY_S[0]
        async with limit:
            for attempt in range(self.retries + 1):
                # An operator's job: `key_id` names whom it runs for, not an API key to check.
                status, body, _busy, _usage = await self.gateway.run_batch_line.remote(
                    self.key_id, line.url, line.body, check_key=False
                )
                if status not in (429, 503) or attempt == self.retries:
                    break
                await asyncio.sleep(wait_s)
                wait_s = min(RETRY_S[1], wait_s * 2)
        return output_record_text(line.custom_id, status, body)


def _custom_id(text: str) -> str:
    try:
        value = json.loads(text).get("custom_id")
    except (ValueError, AttributeError):
        return ""
    return value if isinstance(value, str) else ""


def done_ids(output: Path) -> set[str]:
    """The custom_ids the output has already (the last line may be cut short by a crash: dropped)."""
    if not output.exists():
        return set()
    done = set()
    text = output.read_text()
    if text and not text.endswith("\n"):  # a line cut short: write over it
        text = text[: text.rfind("\n") + 1]
        output.write_text(text)
    for line in text.splitlines():
        if line.strip():
            done.add(json.loads(line)["custom_id"])
    return done


def run(args: argparse.Namespace) -> int:
    import ray

    if not ray.is_initialized():
        address = args.address or os.environ.get("RAY_ADDRESS") or "auto"
        try:
            ray.init(address=address, namespace="raylane", log_to_driver=False, logging_level="ERROR")
        except ConnectionError as e:
            print(f"raylane batch run: no Ray cluster at {address}: {e}", file=sys.stderr)
            return 2
    output = Path(args.output)
    done = done_ids(output)
    ds = ray.data.read_text(args.input).filter(lambda row: bool(row["text"].strip()))
    if done:
        ds = ds.filter(lambda row: _custom_id(row["text"]) not in done)
    sender_args = {"app": args.app, "key_id": args.key_id}
    sender_args |= {"concurrency": args.concurrency, "retries": args.retries}
    results = ds.map_batches(
        LineSender,
        fn_constructor_kwargs=sender_args,
        batch_size=args.concurrency * 4,
        concurrency=args.actors,
        num_cpus=0.1,  # they wait on the gateway: the pools do the work
    )
    written = 0
    with output.open("a") as out:
        for block in results.iter_batches(batch_format="numpy", batch_size=None):
            for record in block["record"]:
                out.write(str(record) + "\n")
                written += 1
            out.flush()
    print(f"raylane batch run: {written} lines written to {output} ({len(done)} there already)")
    return 0
