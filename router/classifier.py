"""The semantic classifier: which route a conversation belongs to, and how sure it is.

Method: a softmax regression on MiniLM embeddings (raylane.router.encoder) beside hashed character n-grams
(raylane.router.ngrams: lexical cues that carry across languages, where English-trained MiniLM does not),
trained at start-up on the labelled prompts (router/dataset/train.tsv plus each route's `examples`)
and on turns that only make sense in their conversation (router/dataset/followups.txt, an internal
`followup` class).
The latest user turn's route scores count in proportion to how self-contained it is; the rest
comes from its context, the system prompt and earlier user turns, each weighted by the config and
by how self-contained it is itself. How self-contained the latest turn is comes from two views that
are averaged in log-odds: the head's `followup` probability (what the whole turn reads like) and a
second small head on the turn's first words alone (raylane.router.ngrams.opening_features), which knows
`¿y cómo evito...`, `et s'il...` as continuations and `Cambiando de tema:` as a new start even
when the content words of a long turn outweigh them in the first view. Confidence is the winning
route's probability; below `confidence_threshold` the default route is taken. Keyword and regex
rules, checked first on the latest user turn, decide outright when exactly one route's rules match.
"""

import hashlib
import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from raylane.config import BUILTIN_DATASET, FOLLOWUP_LABEL, RouterConfig
from raylane.router.dataset import FOLLOWUPS_PATH, TRAIN_PATH, read_labelled, read_lines
from raylane.router.encoder import SentenceEncoder
from raylane.router.ngrams import ngram_features, opening_features
from raylane.router.rules import RouteRules, rule_window
from raylane.router.softmax import SoftmaxRegression

# Weaker than SoftmaxRegression's default: a sparse n-gram (`sql`, `fonction`) seen in a few prompts
# keeps enough weight to count; cross-validation on train.tsv was no worse and less hedged.
L2 = 3e-5
MIN_CONTEXT_SHARE = 0.02  # below this, a turn's context is not even embedded: it could not change much
# The opening head's share of the log-odds that the latest turn continues its conversation. On the
# development conversations, shares 0.35 / 0.5 / 0.65 with 4, 6 or 8 opening tokens all gave 86-88 of
# 90; the head's followup class alone, on the same training data, 85.
OPENING_SHARE = 0.5
_FIT_CODE = inspect.getsource(SoftmaxRegression.fit)  # part of a cached head's key


@dataclass(frozen=True, slots=True)
class RouteDecision:
    route: str
    pool: str | None
    confidence: float  # probability of the best route (1.0 for a rule match)
    method: str  # "semantic", "rule" or "default" (unsure, or nothing to read)
    # Probability of every route; less than 1 in all when a vague turn has no context to settle it.
    scores: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Conversation:
    """The parts of a chat the classifier reads."""

    latest_user: str
    system: str = ""
    earlier_user: tuple[str, ...] = ()  # newest first


def message_text(content: Any) -> str:
    """Text of an OpenAI message `content`: a string or a list of parts (text parts kept)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        return "\n".join(parts)
    return ""


def split_conversation(messages: list[dict]) -> Conversation:
    """The conversation's parts, each text cut to its `rule_window`: nothing after this reads more
    of a multi-megabyte message than its head and tail."""
    system = [_bounded(m.get("content")) for m in messages if m.get("role") in ("system", "developer")]
    users = [_bounded(m.get("content")) for m in messages if m.get("role") == "user"]
    users = [u for u in users if _has_text(u)]
    system = [s for s in system if _has_text(s)]
    if not users:  # a prompt of only a system message (or a completion prompt passed as one)
        return Conversation(latest_user="\n".join(system))
    return Conversation(users[-1], "\n".join(system), tuple(reversed(users[:-1])))


def _bounded(content: Any) -> str:
    return rule_window(message_text(content))


def _has_text(text: str) -> bool:
    return bool(text) and not text.isspace()


class SemanticClassifier:
    def __init__(self, config: RouterConfig, encoder: SentenceEncoder | None = None):
        self.config = config
        self.routes = [r.name for r in config.routes]
        self._pools = {r.name: r.pool for r in config.routes}
        self._rules = {r.name: RouteRules(r.keywords, r.regex) for r in config.routes}
        self.encoder = encoder or SentenceEncoder(config.max_tokens, config.quantize)
        texts, labels = self._training_set()
        vectors = np.hstack([training_embeddings(self.encoder, texts), ngram_features(texts)])
        self.head = fitted_head(vectors, labels, num_classes=len(self.routes) + 1, l2=L2)
        # Continues the conversation (a followups.txt turn) or not (a labelled prompt), by its opening.
        continues = (labels == len(self.routes)).astype(np.int64)
        self.opening = fitted_head(opening_features(texts), continues, num_classes=2, l2=1e-4)
        self.num_examples = len(texts)

    def classify(self, messages: list[dict]) -> RouteDecision:
        """Decide the route of an OpenAI `messages` list."""
        return self.classify_conversation(split_conversation(messages))

    def classify_text(self, text: str) -> RouteDecision:
        """Decide the route of a bare prompt (a completion request, or one user turn)."""
        return self.classify_conversation(Conversation(latest_user=rule_window(text)))

    def classify_conversation(self, conversation: Conversation) -> RouteDecision:
        """Decide the route of a conversation whose texts are already cut to their `rule_window`
        (`split_conversation` does it)."""
        if not _has_text(conversation.latest_user):
            return self._decision(self.config.default_route, 0.0, "default", {})
        ruled = self._rule_match(conversation.latest_user)
        if ruled is not None:
            return self._decision(ruled, 1.0, "rule", {ruled: 1.0})
        scores = self._route_probabilities(conversation)
        best = max(scores, key=scores.__getitem__)
        if scores[best] < self.config.confidence_threshold:
            return self._decision(self.config.default_route, scores[best], "default", scores)
        return self._decision(best, scores[best], "semantic", scores)

    def _route_probabilities(self, conversation: Conversation) -> dict[str, float]:
        """Route -> probability. Without context, a vague latest turn keeps its `followup` share out,
        so its routes' probabilities stay low (and the default route takes it)."""
        latest = self.head.logits(self.features([conversation.latest_user]))[0]
        self_contained = self._self_contained(conversation.latest_user, _softmax(latest)[-1])
        context = self._context_logits(conversation) if self_contained < 1.0 - MIN_CONTEXT_SHARE else None
        if context is None:
            probs = _softmax(latest)[:-1]
        else:
            probs = _softmax(self_contained * latest[:-1] + (1.0 - self_contained) * context)
        return {route: float(p) for route, p in zip(self.routes, probs, strict=True)}

    def _self_contained(self, text: str, followup: float) -> float:
        """1 - P(the turn continues its conversation): the head's `followup` probability and the
        opening head's, averaged in log-odds. Without context the head's own share is kept (above)."""
        opening = self.opening.predict_proba(opening_features([text]))[0, 1]
        log_odds = (1 - OPENING_SHARE) * _logit(followup) + OPENING_SHARE * _logit(opening)
        return float(1.0 / (1.0 + np.exp(log_odds)))

    def _context_logits(self, conversation: Conversation) -> np.ndarray | None:
        """Weighted mean route logits of the system prompt and earlier user turns, or None if none."""
        w = self.config.weights
        parts = [(conversation.system, w.system)] if conversation.system.strip() else []
        for age, text in enumerate(conversation.earlier_user[: w.max_earlier_turns]):
            parts.append((text, w.earlier_user * w.decay**age))
        parts = [(text, weight) for text, weight in parts if weight > 0]
        if not parts:
            return None
        logits = self.head.logits(self.features([text for text, _ in parts]))
        # A part that is itself a follow-up ("thanks!") says little about the route.
        weights = np.asarray([weight for _, weight in parts]) * (1.0 - _softmax(logits)[:, -1])
        if weights.sum() <= 1e-6:
            return None
        return weights @ logits[:, :-1] / weights.sum()

    def features(self, texts: list[str]) -> np.ndarray:
        """What the head reads: the MiniLM embedding, then the character n-grams (both unit length)."""
        return np.hstack([self.encoder.encode(texts), ngram_features(texts)])

    def _rule_match(self, text: str) -> str | None:
        matched = [route for route, rules in self._rules.items() if rules and rules.matches(text)]
        return matched[0] if len(matched) == 1 else None

    def _decision(self, route: str, confidence: float, method: str, scores: dict) -> RouteDecision:
        return RouteDecision(route, self._pools[route], confidence, method, scores)

    def _training_set(self) -> tuple[list[str], np.ndarray]:
        """Texts and class indices: the routes in config order, then the `followup` class."""
        labels = [*self.routes, FOLLOWUP_LABEL]
        rows: list[tuple[str, str]] = [(FOLLOWUP_LABEL, text) for text in read_lines(FOLLOWUPS_PATH)]
        if self.config.dataset is not None:
            path = TRAIN_PATH if self.config.dataset == BUILTIN_DATASET else self.config.dataset
            rows += [(label, text) for label, text in read_labelled(path) if label in labels]
        rows += [(r.name, text) for r in self.config.routes for text in r.examples]
        counts = {route: sum(1 for label, _ in rows if label == route) for route in self.routes}
        empty = [route for route, n in counts.items() if n == 0]
        if empty:
            raise ValueError(
                f"router.routes: {empty} have no examples; give them `examples` or rows in "
                "`raylane.router.dataset`"
            )
        index = {label: i for i, label in enumerate(labels)}
        return [text for _, text in rows], np.asarray([index[label] for label, _ in rows])


def _softmax(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def _logit(p: float) -> float:
    p = min(max(float(p), 1e-6), 1 - 1e-6)
    return float(np.log(p / (1 - p)))


def cache_dir() -> Path:
    return Path(os.environ.get("RAYLANE_CACHE_DIR", "~/.cache/raylane")).expanduser() / "router"


def training_embeddings(encoder: SentenceEncoder, texts: list[str]) -> np.ndarray:
    """Embeddings of the training prompts, from a file cache when this exact set was embedded before.

    Embedding ~600 prompts costs seconds, once per replica start; the cache key covers the texts and
    the encoder's fingerprint (model, torch version, settings, preprocessing), so any change re-embeds.
    """
    key = hashlib.sha256()
    for part in (encoder.fingerprint, *texts):
        key.update(part.encode() + b"\0")
    path = cache_dir() / f"train-{key.hexdigest()[:24]}.npy"
    try:
        cached = np.load(path)
        if cached.shape == (len(texts), encoder.dim):
            encoder.remember(texts, cached)  # a second classifier on this encoder embeds only new texts
            return cached
    except (OSError, ValueError):
        pass
    vectors = encoder.encode(texts)
    _save(path, vectors)
    return vectors


def fitted_head(x: np.ndarray, y: np.ndarray, num_classes: int, l2: float) -> SoftmaxRegression:
    """`SoftmaxRegression.fit(x, y, ...)`, from a file cache when these exact inputs were fit before.

    The fit reads `x` twice per step for 500 steps: for the 819 x 4,480 training set, 9.3 CPU-s
    (`time.process_time()` around it, AMD EPYC family 25, 2026-12-03) at every gateway replica
    start. The key hashes `x`, `y` and the fit's own code, so a change to the dataset, the encoder,
    the features or the fit trains again.
    """
    key = hashlib.sha256(f"{x.shape} {x.dtype} {num_classes} {l2!r}".encode())
    key.update(_FIT_CODE.encode())
    key.update(np.ascontiguousarray(x).tobytes())
    key.update(np.ascontiguousarray(y).tobytes())
    path = cache_dir() / f"head-{key.hexdigest()[:24]}.npy"
    try:
        cached = np.load(path)
        if cached.shape == (x.shape[1] + 1, num_classes):  # the weights, then the bias as a last row
            return SoftmaxRegression(cached[:-1], cached[-1])
    except (OSError, ValueError):
        pass
    head = SoftmaxRegression.fit(x, y, num_classes=num_classes, l2=l2)
    _save(path, np.vstack([head.weights, head.bias]))
    return head


def _save(path: Path, array: np.ndarray) -> None:
    """Best effort, atomic (replicas starting together may write the same file): a read-only file
    system just means computing it again at the next start."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")
        np.save(tmp, array)
        tmp.replace(path)
    except OSError:
        pass
