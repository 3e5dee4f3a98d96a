"""The semantic classifier as a user of `model: "auto"` sees it, and `raylane route`."""

import json
from collections import Counter

import numpy as np
import pytest

from raylane.config import RouterConfig
from raylane.router import classifier as classifier_module
from raylane.router.classifier import SemanticClassifier, fitted_head
from raylane.router.dataset import (
    CONVERSATIONS_DEV_PATH,
    CONVERSATIONS_EVAL_PATH,
    EVAL_PATH,
    FOLLOWUPS_PATH,
    TRAIN_PATH,
    read_conversations,
    read_labelled,
    read_lines,
)
from raylane.router.evaluate import evaluate, evaluate_conversations, humaneval_examples

SYSTEM = {
    "coding": "You are a senior software engineer who reviews Python code and fixes bugs.",
    "reasoning": "You are a patient math tutor who helps students solve algebra and probability problems.",
    "chat": "You are a friendly travel and lifestyle companion.",
}
# Vague turns that are not in followups.txt: held out, like eval.tsv.
VAGUE = [
    "Could you give me a nudge in the right direction?",
    "Is there a quicker way?",
    "Hmm, is that really right?",
]


@pytest.fixture(scope="module")
def classifier():
    """One classifier for the module, on one torch thread as in a gateway replica: on shared cores, a
    second thread spin-waits on the first and makes each 128-token forward pass many times slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield SemanticClassifier(RouterConfig())
    finally:
        torch.set_num_threads(threads)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def test_dataset_is_big_varied_and_held_out():
    train, held_out = read_labelled(TRAIN_PATH), read_labelled(EVAL_PATH)
    assert len(train) + len(held_out) >= 300
    for split in (train, held_out):
        assert {label for label, _ in split} == {"coding", "reasoning", "chat"}
    assert not {text for _, text in train} & {text for _, text in held_out}
    assert not set(VAGUE) & set(read_lines(FOLLOWUPS_PATH))
    lengths = sorted(len(text) for _, text in train + held_out)
    assert lengths[0] < 30 and lengths[-1] > 400  # one-liners and pasted code alike


def test_accuracy_on_held_out_split_is_at_least_95_percent(classifier):
    report = evaluate(classifier, read_labelled(EVAL_PATH))
    assert report.accuracy >= 0.95, "\n".join(report.lines())
    for route in ("coding", "reasoning", "chat"):
        assert report.route_accuracy(route) >= 0.9, "\n".join(report.lines())


def test_conversation_set_is_balanced_multilingual_and_held_out():
    conversations = read_conversations(CONVERSATIONS_EVAL_PATH)
    assert len(conversations) >= 240
    routes = Counter(c.route for c in conversations)
    assert set(routes) == {"coding", "reasoning", "chat"} and max(routes.values()) - min(routes.values()) <= 3
    langs = Counter(c.lang for c in conversations)
    assert langs["es"] + langs["fr"] >= len(conversations) / 3 and min(langs["es"], langs["fr"]) >= 15
    roles = [[m["role"] for m in c.messages] for c in conversations]
    assert sum(r.count("user") > 1 for r in roles) >= 30  # topic shifts and follow-ups
    assert sum("system" in r for r in roles) >= 15  # personas
    # Held out: training never sees a turn of these conversations, nor of the development ones.
    trained = {text for _, text in read_labelled(TRAIN_PATH)} | set(read_lines(FOLLOWUPS_PATH))
    for split in (conversations, read_conversations(CONVERSATIONS_DEV_PATH)):
        assert not {m["content"] for c in split for m in c.messages if m["role"] == "user"} & trained


def _conversation_report(classifier):
    return evaluate_conversations(classifier, read_conversations(CONVERSATIONS_EVAL_PATH))


def _text(report) -> str:
    return "\n".join(report.lines() + [str(m) for m in report.mistakes])


def test_accuracy_on_held_out_conversations_is_at_least_97_percent(classifier):
    """Issue 25 part 3: multi-turn topic shifts, persona system prompts, vague and content-bearing
    follow-ups, Spanish and French, each classified from its messages as the gateway does for
    `model: "auto"`. 97.1% (234/241) when written; router/dataset/README.md has the measurements."""
    report = _conversation_report(classifier)
    assert report.accuracy >= 0.97, _text(report)


def test_held_out_conversations_hold_in_every_language_and_route(classifier):
    """A floor under today's accuracy per language and per route (Spanish 92.8% and coding 95.0% are
    the lowest), so a change that trades one language or route for the others fails here even while
    the total stays above 97%."""
    report = _conversation_report(classifier)
    for lang in ("en", "es", "fr"):
        assert report.group_accuracy(lang) >= 0.9, _text(report)
    for route in ("coding", "reasoning", "chat"):
        assert report.route_accuracy(route) >= 0.93, _text(report)


def test_every_humaneval_prompt_routes_to_coding(classifier):
    report = evaluate(classifier, humaneval_examples())
    assert report.total == 164
    assert report.correct == 164, report.mistakes


def test_humaneval_routes_to_coding_without_the_regex_rules(classifier):
    """The embeddings alone recognise a function stub, not just the `def` regex."""
    no_rules = RouterConfig(routes=[r.model_copy(update={"regex": []}) for r in RouterConfig().routes])
    report = evaluate(SemanticClassifier(no_rules, encoder=classifier.encoder), humaneval_examples())
    assert report.accuracy >= 0.97, report.mistakes


def test_latest_user_turn_outweighs_the_history(classifier):
    cooking = [
        user("What's a good recipe for mushroom risotto?"),
        {"role": "assistant", "content": "Soften an onion in butter, toast the rice, add stock slowly..."},
        user("Can I use white wine instead of some of the broth?"),
        {"role": "assistant", "content": "Yes, a glass of dry white wine works well."},
    ]
    request = user("Now write a python function that scales a recipe's ingredient quantities by a factor.")
    assert classifier.classify([*cooking, request]).route == "coding"
    coding = [user("Write a Rust function that parses one CSV line."), {"role": "assistant", "content": "fn"}]
    dinner = user("Unrelated: what should I cook for dinner tonight?")
    assert classifier.classify([*coding, dinner]).route == "chat"


@pytest.mark.parametrize("route", ["coding", "reasoning", "chat"])
def test_system_prompt_settles_a_vague_turn(classifier, route):
    for text in VAGUE:
        decision = classifier.classify([{"role": "system", "content": SYSTEM[route]}, user(text)])
        assert (decision.route, decision.method) == (route, "semantic"), text


def test_earlier_turns_settle_a_vague_follow_up(classifier):
    for first, route in [
        ("Solve 3x + 5 = 20 and show the steps.", "reasoning"),
        ("My flask app returns 500 on every POST request.", "coding"),
        ("I want to visit Norway in the summer.", "chat"),
    ]:
        history = [user(first), {"role": "assistant", "content": "..."}]
        assert classifier.classify([*history, user("Is there a quicker way?")]).route == route, first


def test_a_follow_up_with_content_words_is_settled_by_its_conversation(classifier):
    """Spanish and French turns that carry words of their own but open as a continuation (`¿y cómo`,
    `et s'il`, `et pour`): the conversation decides, not those words. Not in followups.txt."""
    for first, latest, route in [
        (
            "Tengo un script en Python que lee un CSV de gastos con pandas.",
            "¿y cómo hago para que ignore las filas vacías y sume por categoría?",
            "coding",
        ),
        (
            "Un cycliste roule à 20 km/h pendant 2 heures puis à 30 km/h pendant 1 heure. Vitesse moyenne ?",
            "et s'il fait le retour à 15 km/h, quelle est la moyenne sur l'aller-retour ?",
            "reasoning",
        ),
        ("Je pars à Lisbonne en mai avec des amis.", "et pour sortir le soir, quel quartier ?", "chat"),
    ]:
        history = [user(first), {"role": "assistant", "content": "..."}]
        assert classifier.classify([*history, user(latest)]).route == route, latest
    coding = [
        user("Tengo un script en Python que lee un CSV de gastos con pandas."),
        {"role": "assistant", "content": "..."},
    ]
    change = user("Cambiando de tema: ¿qué novela me recomiendas para el verano?")
    assert classifier.classify([*coding, change]).route == "chat"


def test_system_prompt_does_not_overrule_a_clear_request(classifier):
    proof = user("Prove that the square root of 3 is irrational.")
    assert classifier.classify([{"role": "system", "content": SYSTEM["chat"]}, proof]).route == "reasoning"
    generic = {"role": "system", "content": "You are a helpful assistant."}
    bash = user("write a bash loop that renames *.jpeg to *.jpg")
    assert classifier.classify([generic, bash]).route == "coding"


def test_vague_turn_alone_falls_back_to_the_default_route(classifier):
    decision = classifier.classify([user(VAGUE[0])])
    assert decision.route == "chat" and decision.method == "default"
    assert decision.confidence < RouterConfig().confidence_threshold


def test_confidence_below_threshold_takes_the_default_route(classifier):
    config = RouterConfig(default_route="reasoning", confidence_threshold=1.0)
    strict = SemanticClassifier(config, encoder=classifier.encoder)
    decision = strict.classify([user("Tell me about the history of tea in China.")])
    assert (decision.route, decision.pool, decision.method) == ("reasoning", "reasoning", "default")
    assert decision.scores["chat"] == decision.confidence == max(decision.scores.values())


def test_decision_names_route_pool_and_confidence(classifier):
    decision = classifier.classify([user("What is the probability of two heads in three coin flips?")])
    assert (decision.route, decision.pool, decision.method) == ("reasoning", "reasoning", "semantic")
    assert 0.5 < decision.confidence <= 1.0
    assert set(decision.scores) == {"coding", "reasoning", "chat"}


def test_regex_rule_decides_pasted_code(classifier):
    decision = classifier.classify([user("what's wrong here?\n```\nfor i in range(10) print(i)\n```")])
    assert (decision.route, decision.method, decision.confidence) == ("coding", "rule", 1.0)


def test_a_2_mb_pathological_turn_is_read_only_at_its_head_and_tail(classifier, monkeypatch):
    """Every step before admission reads a bounded part of the text: the rules, the tokenizer, the
    n-grams. What each is handed is recorded; none may be handed more than the rule window."""
    import raylane.router.classifier as module
    from raylane.router.rules import RULE_WINDOW_CHARS, RouteRules

    read: dict[str, int] = {"rules": 0, "tokenizer": 0, "ngrams": 0}

    def longest(step: str, texts) -> None:
        read[step] = max(read[step], *(len(t) for t in texts))

    matches, ngrams, tokenizer = RouteRules.matches, module.ngram_features, classifier.encoder._tokenizer

    class Tokenizer:
        def encode(self, text, **kwargs):
            longest("tokenizer", [text])
            return tokenizer.encode(text, **kwargs)

    monkeypatch.setattr(
        RouteRules, "matches", lambda rules, text: longest("rules", [text]) or matches(rules, text)
    )
    monkeypatch.setattr(module, "ngram_features", lambda texts: longest("ngrams", texts) or ngrams(texts))
    monkeypatch.setattr(classifier.encoder, "_tokenizer", Tokenizer())
    # 2 MB in each of three messages, shaped to keep the default code rule (`^\s*def\s+\w+.*:`) busy.
    attack = "def " + " " * 2_000_000 + "x"
    decision = classifier.classify([{"role": "system", "content": attack}, user(attack), user(attack)])
    assert decision.route in ("coding", "reasoning", "chat")
    assert all(0 < n <= 2 * RULE_WINDOW_CHARS + 1 for n in read.values()), read


def test_the_embedding_cache_keeps_digests_not_client_text(classifier):
    secret = "my card number is 4111 1111 1111 1111, summarise my statement " + "x" * 50_000
    classifier.classify([user(secret)])
    keys = list(classifier.encoder._cache)
    assert keys and all(isinstance(k, bytes) and len(k) == 16 for k in keys)
    assert not any(b"4111" in k for k in keys)


def test_content_parts_and_empty_messages(classifier):
    parts = [
        {"type": "text", "text": "Integrate x^2 sin(x) dx"},
        {"type": "image_url", "image_url": {"url": "https://example.com/x.png"}},
    ]
    assert classifier.classify([{"role": "user", "content": parts}]).route == "reasoning"
    assert classifier.classify([]).method == "default"


def test_a_route_defined_by_a_few_config_examples_is_learned(classifier):
    legal = (
        RouterConfig()
        .routes[2]
        .model_copy(
            update={
                "name": "legal",
                "examples": [
                    "Is a verbal agreement legally binding in California?",
                    "Can my landlord keep my deposit for normal wear and tear?",
                    "What is the difference between a will and a living trust?",
                    "Do I need a lawyer to file for divorce in Ontario?",
                    "Is it legal to record a phone call without telling the other person?",
                    "What happens if I break a non-compete clause?",
                    "How long does a copyright last after the author dies?",
                    "Can my employer fire me for posting on social media?",
                ],
            }
        )
    )
    config = RouterConfig(routes=[*RouterConfig().routes, legal])
    with_legal = SemanticClassifier(config, encoder=classifier.encoder)
    handshake = user("Is a handshake deal enforceable if nothing was signed?")
    assert with_legal.classify([handshake]).route == "legal"
    assert with_legal.classify([user("What's a good birthday gift for my dad?")]).route == "chat"


def count_fits(monkeypatch) -> list[int]:
    """SoftmaxRegression.fit, counted: one entry per head actually trained."""
    fits, fit = [], classifier_module.SoftmaxRegression.fit.__func__
    counted = classmethod(lambda cls, *args, **kw: fits.append(1) or fit(cls, *args, **kw))
    monkeypatch.setattr(classifier_module.SoftmaxRegression, "fit", counted)
    return fits


def test_a_trained_head_is_cached_by_its_exact_inputs(monkeypatch, tmp_path):
    monkeypatch.setenv("RAYLANE_CACHE_DIR", str(tmp_path))
    fits = count_fits(monkeypatch)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(60, 8)), rng.integers(0, 3, size=60)
    first = fitted_head(x, y, num_classes=3, l2=1e-4)
    again = fitted_head(x, y, num_classes=3, l2=1e-4)
    assert len(fits) == 1  # the second came from the file the first wrote
    np.testing.assert_array_equal(again.weights, first.weights)
    np.testing.assert_array_equal(again.bias, first.bias)
    # Any other input trains anew: other labels, other features, another regularisation.
    fitted_head(x, (y + 1) % 3, num_classes=3, l2=1e-4)
    fitted_head(x + 1e-9, y, num_classes=3, l2=1e-4)
    fitted_head(x, y, num_classes=3, l2=1e-3)
    assert len(fits) == 4


def test_a_restarted_gateway_trains_no_head(classifier, monkeypatch):
    """The module's classifier has fitted (or found) the heads of the default routes: a gateway
    replica starting with the same routes finds both and decides as that one does."""
    fits = count_fits(monkeypatch)
    restarted = SemanticClassifier(RouterConfig(), encoder=classifier.encoder)
    assert fits == []
    for text in ("Fix this Python traceback for me.", "Solve 3x + 5 = 20.", "Any tips for Lisbon?"):
        assert restarted.classify([user(text)]) == classifier.classify([user(text)])


def test_cli_prints_one_json_decision_per_line(classifier, monkeypatch, capsys, tmp_path):
    from raylane.cluster.cli import main

    monkeypatch.setattr("raylane.router.classifier.SemanticClassifier", lambda config: classifier)
    prompts = tmp_path / "prompts.txt"
    tutor = {"role": "system", "content": SYSTEM["reasoning"]}
    conversation = {"messages": [tutor, user("Is there a quicker way?")]}
    prompts.write_text("write a go function that reverses a slice\n" + json.dumps(conversation) + "\n")
    assert main(["route", str(prompts)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(d["route"], d["pool"]) for d in lines] == [("coding", "coding"), ("reasoning", "reasoning")]
    assert all(0 <= d["confidence"] <= 1 for d in lines)


def test_cli_eval_prints_accuracy_and_confusion_matrix(classifier, monkeypatch, capsys, tmp_path):
    from raylane.cluster.cli import main

    monkeypatch.setattr("raylane.router.classifier.SemanticClassifier", lambda config: classifier)
    labelled = tmp_path / "labelled.tsv"
    labelled.write_text("coding\tfix my segfault in C\nchat\twhat's a nice gift for my dad\n")
    assert main(["route", "--eval", str(labelled), "--no-humaneval"]) == 0
    out = capsys.readouterr().out
    assert "accuracy 100.0% (2/2)" in out and "confusion" in out


def test_cli_eval_reads_labelled_conversations(classifier, monkeypatch, capsys, tmp_path):
    from raylane.cluster.cli import main

    monkeypatch.setattr("raylane.router.classifier.SemanticClassifier", lambda config: classifier)
    tutor = {"role": "system", "content": SYSTEM["reasoning"]}
    rows = [
        {"route": "reasoning", "lang": "en", "messages": [tutor, user("Is there a quicker way?")]},
        {
            "route": "chat",
            "lang": "es",
            "messages": [user("¿Qué ciudad de Italia me recomiendas visitar en mayo?")],
        },
    ]
    labelled = tmp_path / "chats.jsonl"
    labelled.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main(["route", "--eval", str(labelled), "--no-humaneval"]) == 0
    out = capsys.readouterr().out
    assert "accuracy 100.0% (2/2)" in out and "lang es" in out and "lang en" in out
