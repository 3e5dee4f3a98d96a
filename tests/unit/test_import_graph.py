"""The project's import picture: arrows run one way (DESIGN.md, "Layout").

Read from the source with `ast`, without importing anything: every `import` statement of a project
module counts, including those inside functions (a lazy import is still an arrow between files).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("bench", "cluster", "deployments", "engine", "models", "parallel", "router", "tests")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


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


def test_the_config_imports_nothing_of_the_project():
    graph = import_graph()
    config = {m for m in graph if m == "cluster.config" or m.startswith("cluster.config.")}
    assert config, "cluster.config not found"
    outside = {(m, i) for m in config for i in graph[m] if i not in config and i != "cluster"}
    assert not outside, sorted(outside)


def test_parallel_imports_only_parallel():
    graph = import_graph()
    outside = {
        (m, i) for m in graph if m.startswith("parallel.") for i in graph[m] if not i.startswith("parallel")
    }
    assert not outside, sorted(outside)


def test_a_pool_replica_does_not_import_the_model_its_engine_core_process_runs():
    """A replica's Python imports the serving side; the model, runner and their transformers/torch
    modules load only in the engine core process. Both import in turn when a replica restarts, so
    each module the replica drags along lengthens a recovery (`raylane bench recovery`)."""
    import subprocess
    import sys

    probe = (
        "import sys, deployments.model_pool; "
        "print(sorted(m for m in sys.modules if m.startswith(('models.', 'engine.')) "
        "and m.split('.')[1] in ('decoder', 'loader', 'model_runner', 'llm_engine', 'engine_loop')))"
    )
    command = [sys.executable, "-c", probe]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout
