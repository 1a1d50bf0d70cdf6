"""Built-in plugin registering the model-free agents."""

from __future__ import annotations

from miles_engine import hookimpl
from miles_engine.agents.builtin import NopAgent, OracleAgent
from miles_engine.components import Component


@hookimpl
def miles_register_agents() -> list[Component]:
    return [
        Component("oracle", lambda _opts: OracleAgent(), description="runs the task's reference solution"),
        Component("nop", lambda _opts: NopAgent(), description="does nothing (the must-score-0 check)"),
    ]
