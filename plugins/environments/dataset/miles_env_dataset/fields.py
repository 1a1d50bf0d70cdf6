"""The typed field mapping: which column of a row is the prompt, the answer, the tests, ..."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field, model_validator

from miles_engine.components import Section
from miles_engine.data.errors import DataError

Message = dict[str, Any]


class FieldMap(Section):
    """Column names. A mapped field (not null) must be present in every row; null: not used."""

    prompt: str | None = Field("prompt", description="the user prompt: a string, or a list of OpenAI messages")
    messages: str | None = Field(None, description="OpenAI messages instead of prompt: those before the first "
                                 "assistant turn are the prompt (a transcript row works as a task)")
    answer: str | None = Field("answer", description="the reference answer (task.metadata['answer'])")
    tests: str | None = Field(None, description="test code (a string: tests/test_task.py) or {file name: code}, "
                              "written into the sandbox's tests directory")
    image: str | None = Field(None, description="the container image the row's sandbox runs")
    test_command: str | None = Field(None, description="the command whose exit status scores the row (0: reward 1)")
    task_id: str | None = Field(None, description="the task id (default: a hash of the prompt and the answer)")
    metadata: list[str] = Field(default_factory=list, description="extra columns copied into task.metadata")

    @model_validator(mode="after")
    def _one_prompt(self) -> FieldMap:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("map exactly one of fields.prompt and fields.messages")
        return self


@dataclass
class TaskSpec:
    """One validated row."""

    id: str
    row: int
    prompt: list[Message]
    answer: Any = None
    tests: dict[str, str] | None = None
    image: str | None = None
    test_command: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def sandboxed(self) -> bool:
        return bool(self.image or self.test_command or self.tests)


def _required(row: dict[str, Any], key: str, file: str, number: int) -> Any:
    value = row.get(key)
    if value is None or (isinstance(value, str) and not value.strip()):
        raise DataError(file, "is missing" if value is None else "is empty", row=number, field=key)
    return value


def _string(row: dict[str, Any], key: str, file: str, number: int) -> str:
    value = _required(row, key, file, number)
    if not isinstance(value, str):
        raise DataError(file, f"must be a string, got {type(value).__name__}", row=number, field=key)
    return value


def _prompt_messages(value: Any, key: str, file: str, number: int, until_assistant: bool) -> list[Message]:
    from miles_engine.tito.errors import BadRequest
    from miles_engine.tito.messages import normalize_messages

    if isinstance(value, str) and not until_assistant:
        return [{"role": "user", "content": value}]
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise DataError(file, f"is a string but not JSON messages: {exc}", row=number, field=key) from None
    try:
        normalize_messages(value)
    except BadRequest as exc:
        param = exc.param or ""
        raise DataError(file, exc.message, row=number,
                        field=f"{key}{param[len('messages'):]}" if param.startswith("messages") else key) from None
    first = next((i for i, m in enumerate(value) if m.get("role") == "assistant"), len(value))
    prompt = list(value[:first])
    if not prompt or prompt[-1].get("role") not in ("user", "tool"):
        raise DataError(file, "has no user message to open the task with", row=number, field=key)
    return prompt


def row_to_spec(row: dict[str, Any], fields: FieldMap, file: str, number: int,
                system_prompt: str | None = None) -> TaskSpec:
    if fields.prompt is not None:
        prompt = _prompt_messages(_required(row, fields.prompt, file, number), fields.prompt, file, number, False)
    else:
        prompt = _prompt_messages(_required(row, fields.messages, file, number), fields.messages, file, number, True)
    if system_prompt and prompt[0].get("role") != "system":
        prompt = [{"role": "system", "content": system_prompt}, *prompt]
    answer = _required(row, fields.answer, file, number) if fields.answer else None
    tests = None
    if fields.tests:
        raw = _required(row, fields.tests, file, number)
        tests = {"test_task.py": raw} if isinstance(raw, str) else raw
        if not isinstance(tests, dict) or not all(isinstance(k, str) and isinstance(v, str) and "/" not in k
                                                  and k not in ("", ".", "..") for k, v in tests.items()):
            raise DataError(file, "must be test code (a string) or {file name: code}", row=number, field=fields.tests)
    image = _string(row, fields.image, file, number) if fields.image else None
    command = _string(row, fields.test_command, file, number) if fields.test_command else None
    if fields.task_id:
        task_id = str(_required(row, fields.task_id, file, number))
    else:
        blob = json.dumps([prompt, answer, tests, command], sort_keys=True, default=str)
        task_id = "row-" + hashlib.sha256(blob.encode()).hexdigest()[:12]
    metadata: dict[str, Any] = {}
    for key in fields.metadata:
        if key not in row:
            raise DataError(file, "is missing", row=number, field=key)
        metadata[key] = row[key]
    if answer is not None:
        metadata["answer"] = answer
    return TaskSpec(task_id, number, prompt, answer, tests, image, command, metadata)
