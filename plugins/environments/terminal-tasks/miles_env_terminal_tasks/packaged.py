"""The packaged terminal tasks: Harbor task directories shipped as package data.

Every task runs on the local sandbox without Docker (bash, coreutils, grep/sed/awk, tar/gzip,
find and Debian's stdlib-only ``python3``). Harbor tasks normally get their input files from
the image built from ``environment/Dockerfile``; these tasks have no image, so they ship their
inputs in ``environment/files/`` and follow one convention:

    when a task has no ``docker_image`` and no ``environment/Dockerfile``, the files under
    ``environment/files/`` are uploaded into the task's workdir (``/app``) at setup, before the
    agent starts (the equivalent of a Dockerfile's ``COPY files/ /app/``).

:class:`PackagedTask` implements the convention on top of
:class:`miles_env_harbor.HarborTask` (whose own setup only creates the ``/logs`` directories),
so the same directories also work with any Harbor-format loader that honours it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import Field

from miles_engine.components import Section
from miles_engine.environments.protocol import EpisodeContext
from miles_env_harbor import HarborSource, HarborTask

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
ENV_FILES = "files"


class PackagedTask(HarborTask):
    """A Harbor task whose initial files come from ``environment/files/`` (see module docstring)."""

    @property
    def initial_files_dir(self) -> Path | None:
        files = self.environment_dir / ENV_FILES
        has_image = bool(self.config.environment.docker_image) or (self.environment_dir / "Dockerfile").is_file()
        return files if files.is_dir() and not has_image else None

    async def setup(self, ctx: EpisodeContext) -> None:
        await super().setup(ctx)
        files = self.initial_files_dir
        if files is not None and ctx.sandbox is not None:
            await ctx.sandbox.upload_dir(files, self.workdir)


class PackagedTaskSource(HarborSource):
    """A :class:`HarborSource` that loads :class:`PackagedTask` objects."""

    def load_task(self, task_id: str) -> PackagedTask:
        task = super().load_task(task_id)
        return PackagedTask(
            task.task_dir,
            task.config,
            task.instruction,
            task_id=task.id,
            source=self.name,
            ignore_dockerfile=self.ignore_dockerfile,
            default_network=self.default_network,
        )


class TerminalTasksOptions(Section):
    """Options of the ``terminal-tasks`` environment."""

    include: list[str] = Field(default_factory=list, description="glob patterns on task ids to keep")
    exclude: list[str] = Field(default_factory=list, description="glob patterns on task ids to drop")
    difficulty: list[Literal["easy", "medium", "hard"]] = Field(
        default_factory=list, description="keep only these difficulties (easy, medium, hard); empty keeps all"
    )


def packaged_source(
    include: Sequence[str] = (), exclude: Sequence[str] = (), difficulty: Sequence[str] = ()
) -> PackagedTaskSource:
    """The packaged task set as an environment source named ``terminal-tasks``."""
    patterns = list(include)
    if difficulty:
        wanted = set(difficulty)
        unknown = wanted - {"easy", "medium", "hard"}
        if unknown:
            raise ValueError(f"unknown difficulty {sorted(unknown)}; allowed: easy, medium, hard")
        probe = HarborSource(TASKS_DIR, name="terminal-tasks", include=include, exclude=exclude)
        patterns = [ref.id for ref in probe.list_tasks() if ref.difficulty in wanted] or ["<no task matches>"]
    return PackagedTaskSource(TASKS_DIR, name="terminal-tasks", include=patterns, exclude=exclude)


def make_terminal_tasks(options: TerminalTasksOptions) -> PackagedTaskSource:
    return packaged_source(options.include, options.exclude, options.difficulty)
