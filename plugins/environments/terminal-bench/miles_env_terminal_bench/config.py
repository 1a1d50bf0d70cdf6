"""A typed mirror of terminal-bench 1.x's ``task.yaml`` (and ``solution.yaml``).

Field names and defaults are terminal-bench's (``terminal_bench.handlers.trial_handler.Task``).
Unknown keys are ignored, as terminal-bench ignores them. The pre-``instruction`` spelling
``descriptions: [{key: base, description: ...}]`` is accepted. Every ``parser_name``
terminal-bench ships is read (:mod:`miles_env_terminal_bench.graders`); another one is a
:class:`~miles_engine.errors.TaskUnsupportedError` (the task is excluded, its set goes on). Errors are
:class:`~miles_engine.errors.TaskFormatError` naming the file, the field and its line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from miles_engine.errors import TaskFormatError, TaskUnsupportedError, format_validation_error

from miles_env_terminal_bench.graders import GRADERS

SUPPORTED_PARSERS = tuple(GRADERS)


class Description(BaseModel):
    model_config = ConfigDict(extra="ignore")
    key: str = "base"
    description: str


class TBTaskConfig(BaseModel):
    """One ``task.yaml``."""

    model_config = ConfigDict(extra="ignore")
    instruction: str | None = None
    descriptions: list[Description] | None = None  # the older spelling of `instruction`
    author_name: str | None = None
    author_email: str | None = None
    difficulty: Literal["easy", "medium", "hard", "unknown"] = "unknown"
    category: str = "software_engineering"
    tags: list[str] = Field(default_factory=list)
    parser_name: str = "pytest"
    max_agent_timeout_sec: float = Field(360.0, gt=0)
    max_test_timeout_sec: float = Field(60.0, gt=0)
    run_tests_in_same_shell: bool = False
    disable_asciinema: bool = False
    estimated_duration_sec: float | None = None
    expert_time_estimate_min: float | None = None
    junior_time_estimate_min: float | None = None

    @model_validator(mode="after")
    def _has_instruction(self) -> TBTaskConfig:
        if self.instruction is None and not self.descriptions:
            raise ValueError("task.yaml needs 'instruction' (or the older 'descriptions' list)")
        return self

    @property
    def prompt_text(self) -> str:
        if self.instruction is not None:
            return self.instruction
        assert self.descriptions
        base = next((d for d in self.descriptions if d.key == "base"), self.descriptions[0])
        return base.description


class SolutionStep(BaseModel):
    """One entry of ``solution.yaml``: keystrokes sent to the agent's tmux session."""

    model_config = ConfigDict(extra="ignore")
    command: str
    min_timeout_sec: float = 0.0
    block: bool = False
    append_enter: bool = True


def _key_lines(node: yaml.Node, prefix: str, out: dict[str, int]) -> None:
    """``{dotted.key: line}`` for every mapping key and list entry under ``node``."""
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            dotted = f"{prefix}{key_node.value}"
            out.setdefault(dotted, key_node.start_mark.line + 1)
            _key_lines(value_node, dotted + ".", out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out.setdefault(f"{prefix}{i}", item.start_mark.line + 1)
            _key_lines(item, f"{prefix}{i}.", out)


def _load_yaml(path: Path) -> tuple[Any, dict[str, int]]:
    try:
        text = path.read_text(encoding="utf-8")
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError) as exc:
        raise TaskFormatError(f"{path}: cannot read: {exc}") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise TaskFormatError(f"{where}: invalid YAML: {getattr(exc, 'problem', None) or exc}") from exc
    lines: dict[str, int] = {}
    if node is not None:
        _key_lines(node, "", lines)
    return data, lines


def load_task_yaml(path: Path) -> TBTaskConfig:
    data, lines = _load_yaml(path)
    if not isinstance(data, dict):
        raise TaskFormatError(f"{path}: task.yaml must be a mapping of fields, got {type(data).__name__}")
    try:
        config = TBTaskConfig.model_validate(data)
    except ValidationError as exc:
        raise TaskFormatError(format_validation_error(exc, file=str(path), lines=lines)) from exc
    if config.parser_name not in SUPPORTED_PARSERS:
        line = lines.get("parser_name")
        raise TaskUnsupportedError(f"{path}:{line}: parser_name '{config.parser_name}' is not a parser this reader "
                                   f"knows (terminal-bench's: {', '.join(SUPPORTED_PARSERS)})")
    return config


def load_solution_yaml(path: Path) -> list[SolutionStep]:
    data, lines = _load_yaml(path)
    if not isinstance(data, list):
        raise TaskFormatError(f"{path}: solution.yaml must be a list of {{command: ...}} entries")
    steps: list[SolutionStep] = []
    for i, item in enumerate(data):
        try:
            steps.append(SolutionStep.model_validate(item))
        except ValidationError as exc:
            raise TaskFormatError(format_validation_error(exc, prefix=str(i), file=str(path), lines=lines)) from exc
    return steps
