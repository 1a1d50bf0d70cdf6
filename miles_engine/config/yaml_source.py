"""Load YAML while remembering the line of every dotted key; apply ``key=value`` overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from miles_engine.errors import ConfigError


def _construct(node: yaml.Node, prefix: str, lines: dict[str, int]) -> Any:
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = yaml.safe_load(yaml.serialize(key_node))
            if not isinstance(key, str):
                raise ConfigError(f"{key_node.start_mark.line + 1}: keys must be strings, got {key!r}")
            if key in out:
                raise ConfigError(f"{key_node.start_mark.line + 1}: duplicate key '{prefix}{key}'")
            dotted = f"{prefix}{key}"
            lines[dotted] = key_node.start_mark.line + 1
            out[key] = _construct(value_node, dotted + ".", lines)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_construct(v, f"{prefix}{i}.", lines) for i, v in enumerate(node.value)]
    return yaml.safe_load(yaml.serialize(node))


def load_yaml_with_lines(text: str, *, source: str) -> tuple[dict[str, Any], dict[str, int]]:
    """Parse ``text``; return the mapping and ``{dotted.key: line}``."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        raise ConfigError(f"{where}: invalid YAML: {getattr(exc, 'problem', exc)}") from exc
    if node is None:
        return {}, {}
    if not isinstance(node, yaml.MappingNode):
        raise ConfigError(f"{source}: a recipe must be a mapping of sections, got {node.tag.rsplit(':', 1)[-1]}")
    lines: dict[str, int] = {}
    try:
        data = _construct(node, "", lines)
    except ConfigError as exc:
        raise ConfigError(f"{source}:{exc}") from exc
    return data, lines


def load_yaml_file(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read recipe '{path}': {exc.strerror}") from exc
    return load_yaml_with_lines(text, source=str(path))


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (value parsed as YAML; ``a.0.b`` indexes a list) in place."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override '{item}' is not of the form key=value (e.g. eval.jobs=4)")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"override '{item}': value is not valid YAML: {exc}") from exc
        node: Any = data
        parts = key.split(".")
        for depth, part in enumerate(parts):
            last = depth == len(parts) - 1
            where = ".".join(parts[: depth + 1])
            if isinstance(node, list):  # engines.0.kind=server: a list item by index (len(list) appends)
                if not part.isdigit() or int(part) > len(node):
                    raise ConfigError(f"override '{item}': '{where}' must index the list "
                                      f"'{'.'.join(parts[:depth])}' (0..{len(node)})")
                index = int(part)
                if index == len(node):
                    node.append({})
                if last:
                    node[index] = value
                    break
                node = node[index]
            elif isinstance(node, dict):
                if last:
                    node[part] = value
                    break
                child = node.get(part)
                if child is None:
                    child = node[part] = [] if parts[depth + 1].isdigit() else {}
                node = child
            else:
                raise ConfigError(f"override '{item}': '{'.'.join(parts[:depth])}' is a value, not a section")
    return data
