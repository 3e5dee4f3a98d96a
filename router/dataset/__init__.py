"""The project's labelled routing prompts: `train.tsv` (learned at start-up), `eval.tsv` and
`conversations_eval.jsonl` (held out: only measured), `conversations_dev.jsonl` (not trained on either:
where design choices are measured, so the held-out files stay held out).

Format of the TSV files, one prompt a line: `route<TAB>text`. In `text`, `\\n` is a newline,
`\\t` a tab and `\\\\` a backslash; any other backslash is literal (so a pasted regex like `\\d+`
reads as written).
The conversation file is JSONL: `{"route": ..., "lang": ..., "messages": [OpenAI chat messages]}`.
README.md beside this file says how the prompts were written and where each route's edge lies.
"""

import json
import re
from dataclasses import dataclass
from pathlib import Path

DATASET_DIR = Path(__file__).resolve().parent
TRAIN_PATH = DATASET_DIR / "train.tsv"
EVAL_PATH = DATASET_DIR / "eval.tsv"
FOLLOWUPS_PATH = DATASET_DIR / "followups.txt"  # turns that need their conversation (no route)
CONVERSATIONS_EVAL_PATH = DATASET_DIR / "conversations_eval.jsonl"
CONVERSATIONS_DEV_PATH = DATASET_DIR / "conversations_dev.jsonl"

_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def unescape(text: str) -> str:
    return re.sub(r"\\([nt\\])", lambda m: _ESCAPES[m.group(1)], text)


def read_lines(path: str | Path) -> list[str]:
    """Non-blank lines that are not `#` comments, unescaped."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [unescape(line.strip()) for line in lines if line.strip() and not line.startswith("#")]


def read_labelled(path: str | Path) -> list[tuple[str, str]]:
    """[(route, text)] from a TSV file; blank lines and lines starting with `#` are skipped."""
    rows = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        label, sep, text = line.partition("\t")
        if not sep or not label.strip() or not text.strip():
            raise ValueError(f"{path}:{number}: expected `route<TAB>text`, got {line[:60]!r}")
        rows.append((label.strip(), unescape(text)))
    return rows


@dataclass(frozen=True, slots=True)
class LabelledConversation:
    route: str
    messages: list[dict]  # OpenAI chat messages, as a `model: "auto"` request sends them
    lang: str = "en"  # ISO 639-1 code of the user turns, for per-language accuracy


def read_conversations(path: str | Path) -> list[LabelledConversation]:
    """[LabelledConversation] from a JSONL file, one `{"route", "messages"[, "lang"]}` object a line."""
    rows = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not valid JSON: {e}") from None
        route, messages = obj.get("route"), obj.get("messages")
        if not isinstance(route, str) or not route or not isinstance(messages, list) or not messages:
            raise ValueError(f"{path}:{number}: expected `route` (a string) and `messages` (a list)")
        rows.append(LabelledConversation(route, messages, obj.get("lang", "en")))
    return rows
