"""Options of the ``dataset`` environment (validated; unknown keys are errors)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from miles_engine.components import Section
from miles_engine.data.files import DataFileOptions
from miles_engine.data.splits import SplitOptions
from miles_env_dataset.fields import FieldMap


class GenerateOptions(Section):
    """Write ``path`` at start-up from a packaged generator (when absent or different)."""

    kind: Literal["arithmetic"] = Field("arithmetic", description="arithmetic: one-step word problems")
    rows: int = Field(2000, ge=1, le=1_000_000)
    seed: int = 0
    max_operand: int = Field(9, ge=1, le=10**6, description="operands are drawn from 1..max_operand")
    ops: list[Literal["add", "sub"]] = Field(default_factory=lambda: ["add", "sub"], min_length=1)


class SandboxDefaults(Section):
    workdir: str = Field("/app", description="where a sandboxed row's commands start")
    tests_dir: str = Field("/tests", description="where a row's `tests` files are written")
    test_timeout_s: float = Field(120.0, gt=0, description="deadline of the row's test command")
    default_test_command: str = Field("python3 -m pytest -q -p no:cacheprovider {tests_dir}",
                                      description="scores a row that has tests but no test_command")


class DatasetEnvOptions(DataFileOptions):
    fields: FieldMap = Field(default_factory=FieldMap)
    split_by: SplitOptions = Field(default_factory=SplitOptions, description="train/eval split: `use` picks the "
                                   "side this source lists")
    shuffle_seed: int | None = Field(None, description="list the tasks in this seeded order (the rollout's task "
                                     "stream shuffles again with rollout.task_seed)")
    limit: int | None = Field(None, ge=1, description="keep only the first N rows of the split side (after shuffle)")
    skip_bad_rows: bool = Field(False, description="skip (count and report) unusable rows instead of stopping "
                                "with the first one's error")
    system_prompt: str | None = Field(None, description="prepended to prompts that have no system message")
    max_turns: int = Field(1, ge=1, description="agent turns per episode (1: single-turn; sandboxed rows "
                           "usually want more)")
    sandbox: SandboxDefaults = Field(default_factory=SandboxDefaults)
    generate: GenerateOptions | None = Field(None, description="write `path` from a packaged generator first")
    demo_wrong_fraction: float = Field(0.0, ge=0, le=1, description="share of demonstrations (rows with a "
                                       "numeric answer, for the SFT warm start) answered wrongly")
