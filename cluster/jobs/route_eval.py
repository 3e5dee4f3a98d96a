"""Routing accuracy of the deployed router on a labelled file, as a job.

    ray job submit ... -- python -m raylane.cluster.jobs.route_eval [--labels FILE.tsv] --min-accuracy 0.85

Builds the classifier from the `router` section the cluster runs with (or `--config`), classifies
each `route<TAB>text` line of `--labels` (default: the project's held-out split) and prints accuracy
per route and the confusion matrix (router/evaluate.py). Exits 1 below `--min-accuracy`.
"""

import argparse
import sys

from raylane.cluster.jobs.common import load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="raylane.cluster.jobs.route_eval", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--config", help="cluster config YAML (default: the one Serve deployed)")
    parser.add_argument("--app", default="raylane", help="Serve application name (default raylane)")
    parser.add_argument("--labels", help="TSV `route<TAB>text` (default: the project's evaluation split)")
    parser.add_argument("--min-accuracy", type=float, default=0.0, help="fail below this (0..1)")
    parser.add_argument("--mistakes", action="store_true", help="list the misrouted prompts")
    args = parser.parse_args(argv)

    import torch

    from raylane.config import RouterConfig
    from raylane.router.classifier import SemanticClassifier
    from raylane.router.dataset import EVAL_PATH, read_labelled
    from raylane.router.evaluate import evaluate

    torch.set_num_threads(1)
    config = load_config(args)
    classifier = SemanticClassifier(config.router if config is not None else RouterConfig())
    path = args.labels or EVAL_PATH
    report = evaluate(classifier, read_labelled(path))
    print(f"# {path}: {classifier.num_examples} training prompts")
    print("\n".join(report.lines()))
    if args.mistakes:
        for true, predicted, text in report.mistakes:
            print(f"  {true} -> {predicted}: {text[:100]!r}")
    if report.accuracy < args.min_accuracy:
        print(f"route_eval: accuracy {report.accuracy:.1%} is below {args.min_accuracy:.1%}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
