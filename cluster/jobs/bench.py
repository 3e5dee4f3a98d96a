"""The serving benchmark (bench/serve.py) against the cluster, as a job.

    ray job submit ... -- python -m raylane.cluster.jobs.bench --model chat --num-prompts 64 \
        --concurrency 1,8,32

Takes every `raylane bench serve` option; `--url` (default: this node's Serve proxy) replaces
`--base-url`. The table goes to the job's log; `--out DIR` writes serve.json and serve.png on the
node that ran the job.
"""

import argparse
import os
import sys

from raylane.bench import serve
from raylane.cluster.jobs.common import DEFAULT_URL


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="raylane.cluster.jobs.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--url", default=os.environ.get("RAYLANE_URL", DEFAULT_URL), help="the API root")
    serve.add_arguments(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    known, _ = parser.parse_known_args(argv)
    if "--base-url" not in argv:
        argv += ["--base-url", known.url.rstrip("/") + "/v1"]
    args = parser.parse_args(argv)
    return serve.run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
