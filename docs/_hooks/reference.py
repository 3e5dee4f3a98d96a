"""The docs site's generated references, and the MkDocs hook that writes them into their pages.

A page holds a marker, `<!-- generated: config -->` or `<!-- generated: metrics -->`, which the hook
replaces at build time with a table made from the code: every field of the pydantic config tree
(`raylane.config.ClusterConfig`, its type, default and description) and every Prometheus metric
family the cluster serves on `/metrics` (name, type, labels and help, read from the replicas'
metric sets and from the report calls that name a family inline). Nothing in these pages is copied
by hand, so they cannot drift; `tests/unit/test_docs_reference.py` fails when a field or a metric has
no description.
"""

from __future__ import annotations

import ast
import json
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[2]  # the repository root (the `raylane` package)

# -- config ----------------------------------------------------------------------------------------


@dataclass
class FieldDoc:
    path: str  # `pools[].engine.max_num_seqs`
    type: str
    default: str
    description: str


@dataclass
class SectionDoc:
    path: str  # `` for the root, `pools[]`, `router.routes[]`, ...
    model: type[BaseModel]
    fields: list[FieldDoc]


def config_sections() -> list[SectionDoc]:
    """Every model of the config tree, depth first from `ClusterConfig`, each once (the first path
    that reaches it)."""
    from raylane.config import ClusterConfig

    sections: list[SectionDoc] = []
    seen: set[type] = set()

    def visit(model: type[BaseModel], path: str) -> None:
        if model in seen:
            return
        seen.add(model)
        section = SectionDoc(path, model, [])
        sections.append(section)
        children = []
        for name, info in model.model_fields.items():
            key = f"{path}.{name}" if path else name
            description = (info.description or "").strip()
            section.fields.append(FieldDoc(key, type_name(info.annotation), default_text(info), description))
            children += [(sub, key + suffix) for sub, suffix in nested_models(info.annotation)]
        for sub, key in children:
            visit(sub, key)

    visit(ClusterConfig, "")
    return sections


def nested_models(annotation: Any, suffix: str = "") -> list[tuple[type[BaseModel], str]]:
    """The config models inside a field's type, with the path suffix a list (`[]`) or a dict
    (`.<name>`) adds."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(annotation, suffix)]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return nested_models(args[0], suffix)
    if origin in (list, tuple, set, frozenset):
        return [m for a in args if a is not Ellipsis for m in nested_models(a, suffix + "[]")]
    if origin is dict:
        return nested_models(args[1], suffix + ".<name>")
    return [m for a in args for m in nested_models(a, suffix)]


def type_name(annotation: Any) -> str:
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type):
        return annotation.__name__
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    return str(annotation).replace("typing.", "")


def default_text(info) -> str:
    if info.default_factory is not None:
        try:
            value = info.default_factory()
        except TypeError:  # a factory that takes the validated data
            return "(computed)"
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
        if len(json.dumps(value)) > 60:
            return "(section defaults)"
    elif isinstance(value, list | tuple) and value and isinstance(value[0], BaseModel):
        return "[" + ", ".join(str(getattr(v, "name", "...")) for v in value) + "]"
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def config_markdown() -> str:
    out = []
    for section in config_sections():
        title = f"`{section.path}`" if section.path else "The root: `ClusterConfig`"
        doc = " ".join((section.model.__doc__ or "").split())
        out += [f"### {title}", "", f"*{section.model.__name__}*: {doc}" if doc else "", ""]
        out += ["| field | type | default | description |", "|---|---|---|---|"]
        for f in section.fields:
            cells = [f"`{f.path}`", cell(f.type), cell(f"`{f.default}`"), cell(f.description or "**none**")]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


# -- metrics ---------------------------------------------------------------------------------------


@dataclass
class MetricDoc:
    name: str  # as Prometheus shows it (counters with `_total`)
    type: str
    labels: list[str]
    help: str
    source: str  # the module that defines it


def metric_docs() -> list[MetricDoc]:
    """The families every replica's metric set defines, and those reported inline (a `families`
    dict literal beside its `sample_key` calls)."""
    found = {m.name: m for m in metric_set_docs()}
    for m in inline_family_docs():
        found.setdefault(m.name, m)
    return sorted(found.values(), key=lambda m: m.name)


def metric_set_docs() -> list[MetricDoc]:
    from prometheus_client.metrics import MetricWrapperBase

    from raylane.deployments.metrics import pool
    from raylane.deployments.metrics.batch import BatchMetrics
    from raylane.deployments.metrics.gateway import GatewayMetrics

    docs = []
    pool_metrics = pool.PoolMetrics("pool", "model")
    for metric_set in (GatewayMetrics(), pool_metrics, BatchMetrics()):
        source = type(metric_set).__module__.removeprefix("raylane.").replace(".", "/") + ".py"
        for wrapper in vars(metric_set).values():
            if isinstance(wrapper, MetricWrapperBase):
                docs.append(
                    MetricDoc(
                        full_name(wrapper._name, wrapper._type),
                        wrapper._type,
                        list(wrapper._labelnames),
                        wrapper._documentation,
                        source,
                    )
                )
    # The engine's own counters and gauges: their labels are those of the samples they report.
    pool_metrics.set_engine_stats({stat: 0 for _, _, stat in pool.ENGINE_COUNTERS + pool.POOL_GAUGES})
    samples = {**pool_metrics.counter_values(), **pool_metrics.gauge_values("replica")}
    families = {**pool_metrics.extra_families(), **pool_metrics.gauge_families()}
    for family, (typ, doc) in families.items():
        labels = next(sorted(dict(labels)) for fam, _, labels in samples if fam == family)
        docs.append(MetricDoc(full_name(family, typ), typ, labels, doc, "deployments/metrics/pool.py"))
    return docs


def inline_family_docs() -> list[MetricDoc]:
    """Families reported by a function of their own: `{NAME: ("gauge", "help")}` where NAME is a
    string or a module constant, labels from the dict literals of the `sample_key` calls beside it."""
    docs = []
    for folder in ("deployments", "cluster"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text())
            constants = {
                t.id: node.value.value
                for node in tree.body
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                for t in node.targets
                if isinstance(t, ast.Name) and isinstance(node.value.value, str)
            }
            for func in ast.walk(tree):
                if isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                    docs += families_in(func, constants | string_names(func), str(path.relative_to(ROOT)))
    return docs


def string_names(func) -> dict[str, str]:
    """The names a function binds to a string literal (`family = "raylane_..."`)."""
    return {
        t.id: node.value.value
        for node in ast.walk(func)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        for t in node.targets
        if isinstance(t, ast.Name) and isinstance(node.value.value, str)
    }


def families_in(func, constants: dict[str, str], source: str) -> list[MetricDoc]:
    labels = sorted(
        {
            k.value
            for call in ast.walk(func)
            if isinstance(call, ast.Call) and getattr(call.func, "id", "") == "sample_key"
            if len(call.args) == 3 and isinstance(call.args[2], ast.Dict)
            for k in call.args[2].keys
            if isinstance(k, ast.Constant)
        }
    )
    docs = []
    for node in ast.walk(func):
        if not isinstance(node, ast.Dict):
            continue
        for key, value in zip(node.keys, node.values, strict=True):
            name = key.value if isinstance(key, ast.Constant) else constants.get(getattr(key, "id", ""))
            if not (isinstance(name, str) and name.startswith("raylane_") and isinstance(value, ast.Tuple)):
                continue
            parts = [e.value if isinstance(e, ast.Constant) else None for e in value.elts]
            if len(parts) == 2 and parts[0] in ("counter", "gauge", "histogram"):
                docs.append(MetricDoc(full_name(name, parts[0]), parts[0], labels, parts[1] or "", source))
    return docs


def full_name(family: str, typ: str) -> str:
    return f"{family}_total" if typ == "counter" else family


def metrics_markdown() -> str:
    out = ["| metric | type | labels | help | defined in |", "|---|---|---|---|---|"]
    for m in metric_docs():
        labels = ", ".join(f"`{label}`" for label in m.labels) or "-"
        out.append(f"| `{m.name}` | {m.type} | {labels} | {cell(m.help or '**none**')} | `{m.source}` |")
    return "\n".join(out) + "\n"


def vllm_names_markdown() -> str:
    """`raylane sim-server`'s `/metrics`: the same figures under vLLM's names, labelled `model_name`."""
    from raylane.deployments.metrics import vllm_names

    out = ["| vLLM's name | type | help, or the raylane metric it renames |", "|---|---|---|"]
    for family, names in vllm_names.RENAMED.items():
        out += [f"| `{name}` | as `{family}` | `{family}` |" for name in names]
    out += [f"| `{name}` | gauge | {cell(doc)} |" for name, (doc, _) in vllm_names.GAUGES.items()]
    out += [f"| `{name}_total` | counter | {cell(doc)} |" for name, (doc, _) in vllm_names.COUNTERS.items()]
    return "\n".join(out) + "\n"


# -- the MkDocs hook -------------------------------------------------------------------------------

GENERATED = {
    "<!-- generated: config -->": config_markdown,
    "<!-- generated: metrics -->": metrics_markdown,
    "<!-- generated: vllm-metrics -->": vllm_names_markdown,
}


def on_files(files, config, **_):
    """The benchmark plots (bench/results/*.png) join the site under `plots/`, where the Performance
    page shows them: they are written by the benchmarks, not copied into docs/."""
    from mkdocs.structure.files import File

    for png in sorted((ROOT / "bench" / "results").glob("*.png")):
        files.append(File.generated(config, f"plots/{png.name}", abs_src_path=str(png)))
    return files


def on_page_markdown(markdown: str, **_) -> str:
    for marker, make in GENERATED.items():
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return markdown
