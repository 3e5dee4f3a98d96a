"""`raylane bench grammar-bound`: what a catastrophic client grammar costs, and what the next one pays.

A pool compiles a request's grammar in a `BoundedWorker` process (engine/grammar_compiler.py): a
compile past `GRAMMAR_TIMEOUT_S` kills the worker and the request gets a 400. This times, with the
packaged model's tokenizer, a schema whose compile runs past the bound (an enum of long strings),
then a small schema that must wait for a fresh worker, then the same small schema again (cached).

    raylane bench grammar-bound [--out bench/results/grammar_bound.json]
"""

import argparse
import asyncio
import json
import time
from pathlib import Path

from raylane.bench.common import machine_info, print_table, write_json

CASES = {
    "enum of 40 strings of 2,000 chars": {"enum": ["x" * 2000 + str(i) for i in range(40)]},
    "small object (fresh worker)": {"properties": {"a": {"type": "string"}}},
    "small object (cached)": {"properties": {"a": {"type": "string"}}},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")


async def measure(tokenizer) -> list[dict]:
    from raylane.engine.grammar_compiler import GrammarCompileService, GrammarTooComplex
    from raylane.engine.structured_output import StructuredOutputManager
    from raylane.engine.structured_params import StructuredOutputParams

    info = StructuredOutputManager(tokenizer, len(tokenizer)).tokenizer_info.serialize_json()

    async def fetch() -> str:
        return info

    service = GrammarCompileService(fetch)
    await service.prepare(StructuredOutputParams(json_object=True))  # the worker is up
    rows = []
    for name, schema in CASES.items():
        params = StructuredOutputParams(json_schema=json.dumps(schema), whitespace_flexible=False)
        start = time.perf_counter()
        try:
            await service.prepare(params)
            outcome = "compiled"
        except GrammarTooComplex:
            outcome = "400 grammar_too_complex"
        rows.append({"case": name, "seconds": round(time.perf_counter() - start, 3), "outcome": outcome})
    service.close()
    return rows


def run(args: argparse.Namespace) -> int:
    from raylane.engine.grammar_compiler import GRAMMAR_TIMEOUT_S
    from raylane.engine.tokenizer import load_tokenizer
    from raylane.models.gguf import checkpoint_dir
    from raylane.models.packaged import packaged_model_path

    model = "smollm2-135m-instruct"
    tokenizer = load_tokenizer(checkpoint_dir(str(packaged_model_path(model))))
    rows = asyncio.run(measure(tokenizer))
    machine = machine_info()
    print(
        f"machine: {machine['cpu']}, {machine['cores']} cores; tokenizer of {model}; "
        f"bound {GRAMMAR_TIMEOUT_S:g} s"
    )
    print_table(
        ["grammar", "caller waited (s)", "outcome"],
        [[r["case"], f"{r['seconds']:.2f}", r["outcome"]] for r in rows],
    )
    if args.out:
        write_json(args.out, {"machine": machine, "model": model, "bound_s": GRAMMAR_TIMEOUT_S, "rows": rows})
    return 0
