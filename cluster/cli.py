"""The `raylane` command line: one subcommand per operator task.

Each subcommand's module is imported only when it runs, so `raylane --help` stays fast
and a subcommand's heavy dependencies (torch, ray) load only where needed.
"""

import argparse
import importlib
import sys

# subcommand -> (module with `add_arguments(parser)` and `run(args)`, help text)
SUBCOMMANDS = {
    "demo-models": ("raylane.models.demo", "create the small demo checkpoints (Llama, Qwen3-MoE)"),
    "generate": ("raylane.cluster.generate", "generate text offline with the engine from a local checkpoint"),
    "bench": ("raylane.bench.cli", "run a benchmark (engine, ...) and print its table"),
    "serve": ("raylane.cluster.serve", "serve the OpenAI-compatible API (Ray Serve) in the foreground"),
    "apply": (
        "raylane.cluster.apply",
        "apply a new config to the running cluster without downtime (in place, rolling, drain)",
    ),
    "k8s": ("raylane.cluster.k8s", "render the KubeRay manifests (RayService, RayJobs, ...) of a config"),
    "route": (
        "raylane.cluster.route",
        "show the semantic router's decisions for prompts, or its accuracy (--eval)",
    ),
    "batch": (
        "raylane.cluster.batch_run",
        "run a batch file (OpenAI's batch JSONL) on the cluster with Ray Data, on spare capacity",
    ),
    "sim-server": (
        "raylane.cluster.sim_server",
        "serve a simulated engine (a hardware profile, no weights) as an OpenAI server with vLLM's /metrics",
    ),
    "status": (
        "raylane.cluster.status",
        "show the live cluster's pools, replicas, load, tokens/s and errors",
    ),
}


class ReferenceFormatter(argparse.HelpFormatter):
    """Help that reads as a reference: an option and its text on one line where the terminal allows,
    and its default shown when it has one that its text does not already name."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=36, width=110)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            not action.option_strings
            or action.default in (None, False, argparse.SUPPRESS)
            or "default" in text
            or "%(default)" in text
        ):
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="raylane", description="raylane LLM serving cluster", formatter_class=ReferenceFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(
            name, help=help_text, description=help_text, formatter_class=ReferenceFormatter
        )
        sub_parser.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(sub_parser)
    _format_all(parser)
    return parser


def _format_all(parser: argparse.ArgumentParser) -> None:
    """The reference format for the subcommands' own subcommands too (`k8s render`, `bench serve`)."""
    parser.formatter_class = ReferenceFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _format_all(sub)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return importlib.import_module(args._module).run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
