"""The project's import picture: arrows run one way (DESIGN.md, "Layout").

Read from the source with `ast`, without importing anything: every `import` statement of a project
module counts, including those inside functions (a lazy import is still an arrow between files).
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Each folder of the repository and the name it is imported by (pyproject's package-dir).
PACKAGES = {
    "config": "raylane.config",
    "parallel": "raylane.parallel",
    "models": "raylane.models",
    "engine": "raylane.engine",
    "router": "raylane.router",
    "deployments": "raylane.deployments",
    "cluster": "raylane.cluster",
    "bench": "raylane.bench",
    "tests": "tests",
    "raylane": "raylane",  # the root's own modules (last: every name above starts with it)
}
# What each part may import besides itself (DESIGN.md's table): arrows run down, config is the leaf
# that every part may take, the CLI (cluster/) and the benchmarks sit on top. Tests may import all.
MAY_IMPORT = {
    "raylane": set(),
    "config": set(),
    "parallel": set(),  # torch only
    "models": {"parallel", "config"},
    "engine": {"models", "parallel", "config"},
    "router": {"config"},
    "deployments": {"engine", "models", "parallel", "router", "config"},
    "cluster": {"deployments", "engine", "models", "parallel", "router", "config", "bench"},
    "bench": {"cluster", "deployments", "engine", "models", "parallel", "router", "config"},
}


def in_fresh_interpreter(code: str) -> str:
    """What `code` prints, run by a new Python in the checkout (nothing imported yet)."""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def module_name(path: Path) -> str:
    folder, *parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join([PACKAGES[folder], *(parts[:-1] if parts[-1] == "__init__" else parts)])


def part_of(module: str) -> str:
    """The repository folder a module lives in."""
    return next(
        folder for folder, name in PACKAGES.items() if module == name or module.startswith(name + ".")
    )


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for folder in PACKAGES for p in (ROOT / folder).rglob("*.py")}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules that the file imports (`from a.b import c` counts `a.b.c` when it is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(path, modules) - {name} for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One file-level import cycle (as a list of modules, first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def is_package_init_edge(importer: str, imported: str) -> bool:
    """A package's `__init__` re-exporting its own modules is not an arrow between concepts."""
    return imported.startswith(importer + ".")


def test_no_file_level_import_cycle():
    graph = import_graph()
    graph = {m: {i for i in deps if not is_package_init_edge(m, i)} for m, deps in graph.items()}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_arrows_run_down():
    """No part imports one above it (a cluster/ module from deployments/, the engine from router/),
    so config is the bottom, the CLI the top, and each part can be read without those above it."""
    upward = {
        (m, i)
        for m, deps in import_graph().items()
        if part_of(m) in MAY_IMPORT
        for i in deps
        if part_of(i) not in (part_of(m), "raylane") and part_of(i) not in MAY_IMPORT[part_of(m)]
    }
    assert not upward, sorted(upward)


def test_the_gateway_reaches_the_engine_only_through_the_protocol():
    """deployments/gateway/ runs in the ingress replica: what it needs of the engine (errors that
    cross the handle, sampling parameters) comes through deployments/protocol/."""
    below = ("raylane.engine", "raylane.models", "raylane.parallel")
    direct = {
        (m, i)
        for m, deps in import_graph().items()
        if m.startswith("raylane.deployments.gateway")
        for i in deps
        if i.startswith(below)
    }
    assert not direct, sorted(direct)


FOLDERS = "|".join(f for f in PACKAGES if f not in ("tests", "raylane"))
BARE = re.compile(rf"^\s*(?:from|import)\s+({FOLDERS})\b", re.M)


def test_every_import_names_the_raylane_root():
    """`import engine` would work from a checkout (its root is on sys.path) and fail in an install."""
    bare = [
        f"{path.relative_to(ROOT)}: {m.group(0).strip()}"
        for path in project_modules().values()
        for m in BARE.finditer(path.read_text())
    ]
    assert not bare, bare


def test_a_pool_replica_does_not_import_the_model_its_engine_core_process_runs():
    """A replica's Python imports the serving side; the model, runner and their transformers/torch
    modules load only in the engine core process. Each module the replica drags along lengthens a
    recovery (`raylane bench recovery`): so does any the replica imports before it has started its
    core, which is why the deployment's own module imports no torch at all."""
    probe = (
        "import sys, raylane.deployments.pool.model_pool; print('torch' in sys.modules); "
        "import raylane.deployments.pool.serving_chat, raylane.deployments.pool.serving_responses, "
        "raylane.deployments.pool.serving_completion, raylane.deployments.pool.serving_tokenization, "
        "raylane.deployments.metrics.pool, raylane.engine.async_llm, raylane.engine.core_proc, "
        "raylane.engine.grammar_compiler; "
        "print(sorted(m for m in sys.modules if m.startswith(('raylane.models.', 'raylane.engine.')) "
        "and m.split('.')[2] in ('decoder', 'loader', 'model_runner', 'llm_engine')))"
    )
    assert in_fresh_interpreter(probe) == "False\n[]"


def test_the_gateway_process_imports_no_model_code():
    """The gateway replica runs no model: importing its ingress loads nothing of models/ or parallel/,
    of engine/ only the light modules the protocol shares (errors, sampling and grammar parameters),
    and no torch, xgrammar or transformers (seconds of CPU at every gateway replica's start, and its
    memory; grammars are checked in its bounded worker, which imports them)."""
    probe = (
        "import sys, raylane.deployments.gateway.ingress; "
        "print(sorted(m for m in sys.modules if m.startswith(('raylane.models', 'raylane.parallel', "
        "'raylane.engine.')) and m.split('.')[2] not in "
        "('errors', 'sampling_params', 'structured_params')), "
        "[m for m in ('torch', 'xgrammar', 'transformers') if m in sys.modules])"
    )
    assert in_fresh_interpreter(probe) == "[] []"


def test_the_engines_errors_and_sampling_params_import_alone():
    """What a client of the engine's API needs first (SamplingParams, the errors) costs no torch
    and no engine: `raylane.engine` exports its names lazily."""
    probe = (
        "import sys; from raylane.engine import SamplingParams, EngineDeadError; "
        "print(sorted(m for m in sys.modules if m.startswith('raylane')), 'torch' in sys.modules)"
    )
    loaded = ["raylane", "raylane.engine", "raylane.engine.errors", "raylane.engine.sampling_params"]
    assert in_fresh_interpreter(probe) == f"{loaded} False"
