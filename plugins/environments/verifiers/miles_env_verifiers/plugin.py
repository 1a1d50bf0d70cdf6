"""Registers the ``verifiers`` environment: a Prime Intellect verifiers (v1) taskset."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from miles_engine import hookimpl
from miles_engine.components import Component, Section
from miles_engine.environments.protocol import TaskLimits

from miles_env_verifiers.source import VerifiersSource


class VerifiersOptions(Section):
    """Options of the ``verifiers`` environment (verifiers 0.4.0, the ``verifiers.v1`` API)."""

    taskset: str = Field(min_length=1, description="taskset id: verifiers.v1.tasksets.<id> or an installed module "
                         "<id> exporting one Taskset subclass via __all__")
    config: dict[str, Any] = Field(default_factory=dict, description="the taskset's own config (its TasksetConfig)")
    limit: int | None = Field(None, ge=1, description="use the first N tasks (required for infinite tasksets)")
    max_turns: int = Field(16, ge=1)
    agent_timeout_s: float = Field(600.0, gt=0)
    scoring_timeout_s: float = Field(300.0, gt=0, description="bound on the taskset's rewards, metrics and judges")


def make_source(options: VerifiersOptions) -> VerifiersSource:
    limits = TaskLimits(max_turns=options.max_turns, agent_timeout_s=options.agent_timeout_s,
                        verifier_timeout_s=options.scoring_timeout_s)
    return VerifiersSource(options.taskset, config=options.config, limit=options.limit, limits=limits)


@hookimpl
def miles_register_environments() -> list[Component]:
    return [Component("verifiers", make_source, options=VerifiersOptions,
                      description="Prime Intellect verifiers tasksets (verifiers.v1): our agent generates, "
                                  "the taskset's rewards score")]
