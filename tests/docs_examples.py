"""The code blocks of the docs (docs/**/*.md and README.md) that a user would paste: found, and run
against a live server (tests/integration/test_docs_examples.py).

A page's Python blocks run in order as one script, as a reader runs them in one session (a later block
may use the `client` an earlier one made); each shell block runs on its own with `bash -e`, its `curl`
failing on an HTTP error. The address the docs use, `http://127.0.0.1:8000` (or `localhost:8000`), is
replaced by the live server's. A block that cannot run there (it needs Kubernetes, starts a server in
the foreground, runs for an hour) carries a marker on the line before its fence, with the reason:

    <!-- not tested: needs a Kubernetes cluster with KubeRay -->

YAML blocks are cluster configs, or sections of one: tests/unit/test_docs_config_examples.py validates
them against `ClusterConfig`. Blocks in other languages (text, ...) are left alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS_ADDRESS = re.compile(r"(https?://)?(127\.0\.0\.1|localhost):8000")
NOT_TESTED = re.compile(r"^<!--\s*not tested:\s*(?P<why>.*\S)\s*-->$")
FENCE = re.compile(r"^(?P<ticks>`{3,})(?P<lang>[\w+-]*)\s*$")
LANGUAGES = {"python": "python", "py": "python", "bash": "shell", "sh": "shell", "shell": "shell"}
LANGUAGES |= {"yaml": "yaml", "yml": "yaml"}


@dataclass(frozen=True)
class Example:
    page: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    language: str  # python, shell or yaml (a cluster config, or part of one: validated, not run)
    code: str
    not_tested: str | None  # the marker's reason, or None: the block runs


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def examples(path: Path) -> list[Example]:
    """The Python, shell and YAML blocks of one markdown file, in order."""
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == fence["ticks"])
        language = LANGUAGES.get(fence["lang"].lower())
        if language:
            before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marker = NOT_TESTED.match(before)
            code = "\n".join(lines[i + 1 : end]) + "\n"
            page = str(path.relative_to(REPO))
            found.append(Example(page, i + 1, language, code, marker["why"] if marker else None))
        i = end + 1
    return found


def all_examples() -> list[Example]:
    return [example for path in pages() for example in examples(path)]


def at(code: str, url: str) -> str:
    """`code` with the docs' address replaced by `url` (`http://HOST:PORT`)."""
    host_port = url.split("://", 1)[1]
    return DOCS_ADDRESS.sub(lambda m: (m[1] or "") + host_port, code)


def python_script(page_examples: list[Example], url: str) -> tuple[str, list[tuple[int, int]]]:
    """A page's Python blocks as one script, and (script line, page line) where each block starts."""
    parts, starts, line = [], [], 1
    for example in page_examples:
        starts.append((line + 1, example.line + 1))
        part = f"# {example.page}:{example.line}\n{at(example.code, url)}"
        parts.append(part)
        line += part.count("\n")
    return "".join(parts), starts


# Each shell block's prelude: curl fails on an HTTP error (and says why) rather than printing it.
SHELL_PRELUDE = 'curl() { command curl --fail-with-body --show-error "$@"; }\n'
