"""NeMo Gym dataset rows: loading (JSONL or Hugging Face ``datasets``) and reading them as tasks.

A row is ``{"responses_create_params": {"input": [...] | str, "tools": [...], "instructions"?: str},
...verifier fields}``. ``input`` items are Responses-API input items (messages with string or
``input_text`` parts, ``function_call``, ``function_call_output``); tools are Responses-API
function tools (``{"type": "function", "name", "description", "parameters"}``). The whole row
is what NeMo Gym's agents send to ``/seed_session`` and, with ``response`` added, to ``/verify``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_engine.environments.protocol import Message, ToolSpec
from miles_engine.errors import ConfigError, TaskFormatError

# routes every resources server has; a tool with one of these names would shadow them
RESERVED_ROUTES = frozenset({"seed_session", "verify", "aggregate_metrics", "close_session", "sandbox_access",
                             "reverify_mode", "mcp"})
TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass(frozen=True)
class Row:
    task_id: str
    data: dict[str, Any]
    where: str  # "file:line" or "dataset[split][index]", for errors


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            is_text = isinstance(part, dict) and part.get("type") in TEXT_PARTS and isinstance(part.get("text"), str)
            if not is_text:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise TaskFormatError(f"{where}: message content part of type {kind!r} is not supported "
                                      f"(text parts only: {', '.join(TEXT_PARTS)})")
            texts.append(part["text"])
        return "".join(texts)
    raise TaskFormatError(f"{where}: message content must be a string or a list of text parts")


def prompt_messages(params: dict[str, Any], where: str) -> list[Message]:
    """The row's opening conversation as chat messages."""
    messages: list[Message] = []
    instructions = params.get("instructions")
    if instructions:
        messages.append({"role": "system", "content": _text(instructions, f"{where}: instructions")})
    items = params.get("input")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise TaskFormatError(f"{where}: responses_create_params.input must be a string or a non-empty list")
    for i, item in enumerate(items):
        at = f"{where}: responses_create_params.input[{i}]"
        if not isinstance(item, dict):
            raise TaskFormatError(f"{at} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise TaskFormatError(f"{at}: role {role!r} is not one of system, developer, user, assistant")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text(item.get("content"), at)})
        elif kind == "function_call":
            call = {"id": str(item.get("call_id", f"call_{i}")), "type": "function",
                    "function": {"name": str(item.get("name", "")), "arguments": str(item.get("arguments", "{}"))}}
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                             "content": output if isinstance(output, str) else json.dumps(output)})
        else:
            raise TaskFormatError(f"{at}: input item type {kind!r} is not supported "
                                  f"(message, function_call, function_call_output)")
    if not any(m["role"] == "user" for m in messages):
        raise TaskFormatError(f"{where}: responses_create_params.input has no user message")
    return messages


def row_tools(params: dict[str, Any], where: str) -> list[ToolSpec]:
    """The row's function tools (Responses-API shape) as tool specs."""
    raw = params.get("tools") or []
    if not isinstance(raw, list):
        raise TaskFormatError(f"{where}: responses_create_params.tools must be a list")
    tools: list[ToolSpec] = []
    for i, tool in enumerate(raw):
        at = f"{where}: responses_create_params.tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise TaskFormatError(f"{at}: only function tools are supported, got type {kind!r}")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise TaskFormatError(f"{at}: a function tool needs a 'name'")
        if name in RESERVED_ROUTES:
            raise TaskFormatError(f"{at}: tool name '{name}' is a resources-server route "
                                  f"({', '.join(sorted(RESERVED_ROUTES))})")
        if any(t.name == name for t in tools):
            raise TaskFormatError(f"{at}: tool '{name}' is listed twice")
        params_schema = tool.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params_schema, dict):
            raise TaskFormatError(f"{at}: 'parameters' of tool '{name}' must be a JSON schema object")
        tools.append(ToolSpec(name=name, description=str(tool.get("description") or ""), parameters=params_schema))
    return tools


def _checked(data: Any, where: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise TaskFormatError(f"{where}: a row must be a JSON object, got {type(data).__name__}")
    params = data.get("responses_create_params")
    if not isinstance(params, dict):
        raise TaskFormatError(f"{where}: the row has no 'responses_create_params' object")
    prompt_messages(params, where)
    row_tools(params, where)
    return data


def _with_ids(raw: Iterable[tuple[Any, str]], id_field: str | None, limit: int | None) -> list[Row]:
    rows: list[Row] = []
    seen: dict[str, str] = {}
    for index, (data, where) in enumerate(raw):
        if limit is not None and index >= limit:
            break
        data = _checked(data, where)
        if id_field is None:
            task_id = f"row-{index:06d}"
        else:
            value = data.get(id_field)
            if not isinstance(value, (str, int)) or isinstance(value, bool) or str(value).strip() == "":
                raise TaskFormatError(f"{where}: id field '{id_field}' is missing or not a string/integer")
            task_id = str(value)
        if task_id in seen:
            raise TaskFormatError(f"{where}: task id '{task_id}' repeats the one at {seen[task_id]}")
        seen[task_id] = where
        rows.append(Row(task_id, data, where))
    return rows


def _jsonl(path: Path) -> Iterable[tuple[Any, str]]:
    if not path.is_file():
        raise ConfigError(f"nemo-gym: dataset file {path} does not exist (option 'jsonl')")
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                yield json.loads(line), where
            except json.JSONDecodeError as exc:
                raise TaskFormatError(f"{where}: invalid JSON: {exc.msg} (column {exc.colno})") from exc


def _hf(name: str, config: str | None, split: str) -> Iterable[tuple[Any, str]]:
    try:
        import datasets
    except ImportError as exc:
        raise ConfigError("nemo-gym: option 'hf_dataset' needs the 'datasets' package "
                          "(pip install 'miles-env-nemo-gym[hf]')") from exc
    try:
        local = Path(name).expanduser()
        if local.is_dir() and any((local / f).exists() for f in ("dataset_dict.json", "state.json")):
            loaded = datasets.load_from_disk(str(local))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise ConfigError(f"nemo-gym: dataset {name} has no split '{split}' (splits: {', '.join(loaded)})")
                loaded = loaded[split]
        else:
            loaded = datasets.load_dataset(name, config, split=split)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"nemo-gym: cannot load Hugging Face dataset '{name}' (split '{split}'): "
                          f"{type(exc).__name__}: {exc}") from exc
    for index, data in enumerate(loaded):
        yield _decode_json_columns(data), f"{name}[{split}][{index}]"


def _decode_json_columns(data: dict[str, Any]) -> dict[str, Any]:
    """Datasets often store nested params as a JSON string column; decode it back."""
    params = data.get("responses_create_params")
    if isinstance(params, str):
        try:
            data = {**data, "responses_create_params": json.loads(params)}
        except json.JSONDecodeError:
            pass  # _checked names the bad row
    return data


def load_rows(*, jsonl: str | None, hf_dataset: str | None, hf_config: str | None = None, hf_split: str = "train",
              id_field: str | None = None, limit: int | None = None) -> list[Row]:
    """Every row, validated, with unique task ids (errors name the file and line or dataset index)."""
    raw = _jsonl(Path(jsonl).expanduser()) if jsonl is not None else _hf(str(hf_dataset), hf_config, hf_split)
    return _with_ids(raw, id_field, limit)
