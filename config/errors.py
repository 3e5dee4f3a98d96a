"""`ConfigError`: a config that does not load or validate, with one line per field."""

from typing import Any

from pydantic import ValidationError


class ConfigError(ValueError):
    """A config file that does not load or validate; each line of the message names a field."""


def format_errors(error: ValidationError, data: Any, source: str) -> str:
    lines = [f"{source}: {error.error_count()} invalid field(s)"]
    for err in error.errors(include_url=False):
        field = field_path(err["loc"], data)
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            message = "unknown field"
        lines.append(
            f"  {field}: {message}" if field else f"  {message}"
        )  # top-level checks name their field
    return "\n".join(lines)


def field_path(loc: tuple, data: Any = None) -> str:
    """('pools', 1, 'replicas') -> 'pools[1] (reasoning).replicas', naming list items by their `name`."""
    out, node = "", data
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            node = node[part] if isinstance(node, list) and part < len(node) else None
            if isinstance(node, dict) and isinstance(node.get("name"), str):
                out += f" ({node['name']})"
        else:
            out += f".{part}" if out else str(part)
            node = node.get(part) if isinstance(node, dict) else None
    return out
