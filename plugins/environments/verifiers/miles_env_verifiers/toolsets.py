"""A verifiers task's toolsets (``@vf.tool`` methods) offered to our agent, called in-process.

verifiers serves each Toolset as an MCP server in its own runtime; here the tool methods run in
the episode's process instead, which is faithful for stateless toolsets (the base ``State``).
A toolset with its own State subclass syncs that state over verifiers' rollout channel, which
this adapter does not provide, so such tasks are refused at load with the toolset named.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

from pydantic import ConfigDict, ValidationError, create_model

from miles_engine.environments.protocol import ToolSpec
from miles_engine.errors import TaskFormatError


def _params_model(fn: Any) -> Any:
    fields: dict[str, Any] = {}
    for name, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        annotation = Any if param.annotation is inspect.Parameter.empty else param.annotation
        default = ... if param.default is inspect.Parameter.empty else param.default
        fields[name] = (annotation, default)
    return create_model(f"{fn.__name__}_args", __config__=ConfigDict(extra="forbid"), **fields)


class BoundTool:
    def __init__(self, toolset: Any, fn: Any) -> None:
        self.toolset = toolset
        self.fn = fn
        self.name = getattr(fn, "tool_name", None) or fn.__name__
        self.model = _params_model(fn)
        schema = self.model.model_json_schema()
        schema.pop("title", None)
        self.spec = ToolSpec(name=self.name, description=(fn.__doc__ or "").strip() or self.name,
                             parameters={"type": "object", **schema})

    async def call(self, arguments: dict[str, Any]) -> tuple[str, bool]:
        try:
            args = self.model.model_validate(arguments)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(arguments)'}: {e['msg']}"
                                 for e in exc.errors())
            return f"error: invalid arguments for '{self.name}': {problems}", True
        try:
            result = self.fn(**{k: getattr(args, k) for k in type(args).model_fields})
            if inspect.isawaitable(result):
                result = await result
        except Exception as exc:  # a raising tool is the model's feedback, as in verifiers' MCP servers
            return f"error: tool '{self.name}' raised {type(exc).__name__}: {exc}", True
        if isinstance(result, str):
            return result, False
        return json.dumps(result, ensure_ascii=False, default=str), False


def task_toolsets(task: Any, taskset: Any, task_label: str) -> list[Any]:
    """The toolset instances a verifiers task uses (its own and its taskset's), refusing stateful ones."""
    from verifiers.v1.state import State, state_cls

    toolsets = [*type(task).toolsets(task.config), *type(taskset).toolsets(taskset.config)]
    for toolset in toolsets:
        if state_cls(type(toolset)) is not State:
            raise TaskFormatError(
                f"task '{task_label}': toolset {type(toolset).__name__} keeps its own State "
                f"({state_cls(type(toolset)).__name__}), which needs verifiers' rollout state channel; "
                "the miles verifiers adapter runs only stateless toolsets")
    return toolsets


def bind_tools(toolsets: list[Any], task_label: str) -> dict[str, BoundTool]:
    from verifiers.v1.utils.decorators import discover_decorated

    tools: dict[str, BoundTool] = {}
    for toolset in toolsets:
        for fn in discover_decorated(toolset, "tool"):
            tool = BoundTool(toolset, fn)
            if tool.name in tools:
                raise TaskFormatError(f"task '{task_label}': two toolsets offer a tool named '{tool.name}'")
            tools[tool.name] = tool
    return tools
