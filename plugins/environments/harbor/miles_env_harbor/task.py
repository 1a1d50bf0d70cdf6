"""One Harbor task directory as a miles :class:`~miles_engine.environments.protocol.Task`.

Layout (Harbor's)::

    instruction.md        the prompt
    task.toml             config (see :mod:`miles_env_harbor.config`)
    environment/          Dockerfile (or docker-compose.yaml) and its build context
    tests/test.sh         the verifier; uploaded to /tests only at verification time
    solution/solve.sh     optional reference solution (the oracle agent runs it)

A multi-step task (``[[steps]]`` in task.toml) has ``steps/<name>/instruction.md`` (+ ``tests/``,
``solution/``, ``workdir/``) per step instead of the top-level instruction; see
:mod:`miles_env_harbor.steps`. After the episode, ``/logs/artifacts`` and the declared
``artifacts`` are copied out onto the episode's info (:mod:`miles_env_harbor.artifacts`).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Literal

from miles_engine.environments.base import SandboxTask
from miles_engine.environments.protocol import (
    EpisodeContext,
    Message,
    NoReferenceSolution,
    RewardResult,
    TaskLimits,
    ToolResult,
)
from miles_engine.errors import SandboxUnsupportedError, TaskFormatError, TaskUnsupportedError
from miles_engine.sandbox.compose import load_services
from miles_engine.sandbox.healthcheck import Healthcheck, wait_healthy
from miles_engine.sandbox.protocol import BuildContext, NetworkPolicy, Resources, SandboxSpec

from miles_env_harbor import steps, verifier
from miles_env_harbor.artifacts import gather_artifacts
from miles_env_harbor.config import (
    EnvironmentSection,
    HarborNetworkMode,
    StepSection,
    TaskConfig,
    load_task_config,
    resolve_env,
)

log = logging.getLogger(__name__)

DefaultNetwork = Literal["none", "public"]
TASK_PATHS: tuple[str, ...] = ("/app", "/logs", "/tests", "/solution")
MAIN_SERVICE = "main"  # the agent's container in a Harbor compose overlay
DEFAULT_WORKDIR = "/app"
VERIFY_GRACE_S = 30.0  # on top of [verifier].timeout_sec, for uploads and reading reward files
ARTIFACTS_KEY = "artifacts"  # ctx.info key of the artifacts copied out after the episode
_ENTRYPOINT_RE = re.compile(r"^\s*ENTRYPOINT\s", re.IGNORECASE | re.MULTILINE)


def declares_entrypoint(dockerfile: Path) -> bool:
    """Whether a Dockerfile sets an ENTRYPOINT (Harbor keeps it; only its CMD is replaced)."""
    try:
        return bool(_ENTRYPOINT_RE.search(dockerfile.read_text(encoding="utf-8", errors="replace")))
    except OSError:
        return False


def _network(mode: HarborNetworkMode | None, hosts: list[str] | None, default: DefaultNetwork) -> NetworkPolicy:
    if mode is None:
        return NetworkPolicy(mode=default)
    if mode == "allowlist":
        return NetworkPolicy(mode="allowlist", allowed_hosts=tuple(hosts or ()))
    return NetworkPolicy(mode="public" if mode == "public" else "none")


class HarborTask(SandboxTask):
    """A Harbor task. Build one with :func:`load_harbor_task` (which validates the directory)."""

    def __init__(self, task_dir: Path, config: TaskConfig, instruction: str, *, task_id: str | None = None,
                 source: str = "harbor", ignore_dockerfile: bool = False, default_network: DefaultNetwork = "none"):
        limits = _limits(config)
        metadata: dict[str, Any] = {
            "source": source,
            "path": str(task_dir),
            "format": "harbor",
            "schema_version": config.schema,
            "difficulty": config.difficulty,
            "category": config.category,
            "tags": list(config.tags),
            "verifier_mode": config.verifier.environment_mode,
        }
        if config.steps:
            metadata["steps"] = [step.name for step in config.steps]
            metadata["reward_strategy"] = config.reward_strategy
        if config.task and config.task.name:
            metadata["harbor_name"] = config.task.name
        if config.unknown_keys:
            metadata["unknown_keys"] = config.unknown_keys
        if config.environment.mcp_servers:  # what a harness hands its agent CLI (see the README)
            metadata["mcp_servers"] = [server.model_dump(exclude_none=True)
                                       for server in config.environment.mcp_servers]
        super().__init__(task_id or task_dir.name, limits=limits, metadata=metadata)
        self.task_dir = task_dir
        self.config = config
        self.instruction = instruction
        self.ignore_dockerfile = ignore_dockerfile
        self.default_network: DefaultNetwork = default_network
        self.toml_path = task_dir / "task.toml"
        self.steps: list[StepSection] = list(config.steps or [])
        self.step_instructions = [_read_instruction(self.step_dir(s.name) / "instruction.md") for s in self.steps]

    # -- paths ---------------------------------------------------------------------------
    @property
    def tests_dir(self) -> Path:
        return self.task_dir / "tests"

    @property
    def solution_dir(self) -> Path:
        return self.task_dir / "solution"

    @property
    def environment_dir(self) -> Path:
        return self.task_dir / "environment"

    def step_dir(self, name: str) -> Path:
        return self.task_dir / "steps" / name

    @property
    def has_reference_solution(self) -> bool:
        """``solution/solve.sh``; a multi-step task: some step's ``steps/<name>/solution/solve.sh``."""
        if self.steps:
            return any((self.step_dir(s.name) / "solution" / "solve.sh").is_file() for s in self.steps)
        return (self.solution_dir / "solve.sh").is_file()

    @property
    def workdir(self) -> str:
        return self.config.environment.workdir or DEFAULT_WORKDIR

    # -- prompt and sandbox --------------------------------------------------------------
    def prompt(self) -> list[Message]:
        if self.steps:
            return [steps.instruction_message(self, 0)]
        return [{"role": "user", "content": self.instruction}]

    def _userland(self, env: EnvironmentSection, *, tests_dockerfile: bool) -> tuple[str | None, BuildContext | None]:
        if self.ignore_dockerfile:
            return None, None
        if env.docker_image:
            return env.docker_image, None
        if tests_dockerfile and (self.tests_dir / "Dockerfile").is_file():
            return None, BuildContext(context_dir=self.tests_dir)
        if (self.environment_dir / "Dockerfile").is_file():
            return None, BuildContext(context_dir=self.environment_dir)
        if (self.environment_dir / "docker-compose.yaml").is_file() or (self.environment_dir / "docker-compose.yml").is_file():
            raise SandboxUnsupportedError(
                f"task '{self.id}' ({self.task_dir}) defines its environment only as Docker Compose "
                f"(environment/docker-compose.yaml), which no miles sandbox backend supports yet; "
                f"set [environment].docker_image, add environment/Dockerfile, or load the source with "
                f"ignore_dockerfile=true to run on the backend's default userland"
            )
        return None, None

    def _entrypoint_dockerfile(self, image: str | None, build: BuildContext | None) -> Path | None:
        """The Dockerfile of the task's image when it declares an ENTRYPOINT (a named image is
        judged by the environment/Dockerfile that ships with it, when there is one)."""
        if build is not None:
            dockerfile = build.context_dir / build.dockerfile
        elif image is not None:
            dockerfile = self.environment_dir / "Dockerfile"
        else:
            return None
        return dockerfile if declares_entrypoint(dockerfile) else None

    def _spec(self, env: EnvironmentSection, network: NetworkPolicy, *, role: str, image: str | None,
              build: BuildContext | None, user: str | int | None) -> SandboxSpec:
        workdir = env.workdir or DEFAULT_WORKDIR
        paths = TASK_PATHS if workdir in TASK_PATHS else (*TASK_PATHS, workdir)
        return SandboxSpec(
            image=image,
            build=build,
            workdir=workdir,
            paths=paths,
            env=resolve_env(env.env, where=f"{self.toml_path} [environment].env"),
            resources=Resources(**env.explicit_resources()),
            network=network,
            labels={"miles.source": str(self.metadata["source"]), "miles.task": self.id, "miles.role": role},
            user=None if user is None else str(user),
            keep_entrypoint=self._entrypoint_dockerfile(image, build) is not None,
        )

    def sandbox_spec(self) -> SandboxSpec:
        """The agent's sandbox: [environment] plus the [agent] phase's network and user; the
        services of an environment/docker-compose.yaml overlay besides ``main`` are its sidecars."""
        env = self.config.environment
        agent = self.config.agent
        mode = agent.network_mode or env.declared_network()
        hosts = agent.allowed_hosts if agent.network_mode else env.allowed_hosts
        image, build = self._userland(env, tests_dockerfile=False)
        spec = self._spec(env, _network(mode, hosts, self.default_network), role="agent",
                          image=image, build=build, user=agent.user)
        overlay = self._compose_overlay()
        if overlay is None or self.ignore_dockerfile:
            return spec
        # Compose fills unset variables with "" (and warns); Harbor's own ones name host paths.
        loaded = load_services(overlay, main=MAIN_SERVICE, variables=dict(os.environ), strict=False)
        # main's compose limits and environment fill in what [environment] leaves unset (task.toml wins)
        given = spec.resources.model_dump(exclude_unset=True)
        resources = spec.resources.model_copy(update={k: v for k, v in loaded.main_limits.resources.model_dump(
            exclude_none=True, exclude_unset=True).items() if k not in given})
        return spec.model_copy(update={"services": loaded.sidecars, "volumes": loaded.main_volumes,
                                       "resources": resources, "env": {**loaded.main_env, **spec.env}})

    def _compose_overlay(self) -> Path | None:
        for name in ("docker-compose.yaml", "docker-compose.yml"):
            if (self.environment_dir / name).is_file():
                return self.environment_dir / name
        return None

    def need_origin(self, need: str) -> str | None:
        """Where this task asks for a sandbox need (``need``: an ``UnmetNeed.field``): the file and key."""
        env, agent, toml = self.config.environment, self.config.agent, self.toml_path
        overlay = self._compose_overlay()
        if need == "network":
            if agent.network_mode:
                return f"{toml} [agent].network_mode = '{agent.network_mode}'"
            if env.network_mode or env.allow_internet is not None:
                key = "network_mode" if env.network_mode else "allow_internet"
                return f"{toml} [environment].{key} = {getattr(env, key)!r}"
            return f"the environment's option default_network = '{self.default_network}' ({toml} declares none)"
        origins = {
            "gpus": f"{toml} [environment].gpus = {env.gpus}",
            "image": f"{toml} [environment].docker_image = '{env.docker_image}'",
            "build": f"{self.environment_dir / 'Dockerfile'}",
            "paths": f"Harbor's task layout ({', '.join(TASK_PATHS)})"
                     + (f" and {toml} [environment].workdir = '{env.workdir}'" if env.workdir else ""),
            "user": f"{toml} [agent].user = {agent.user!r}",
            "cpus": f"{toml} [environment].cpus = {env.cpus:g}",
            "memory": f"{toml} [environment].memory_mb = {env.effective_memory_mb}",
            "services": f"{overlay} (services besides '{MAIN_SERVICE}')" if overlay else None,
            "volumes": f"{overlay} services.{MAIN_SERVICE}.volumes" if overlay else None,
            "entrypoint": self._entrypoint_origin(),
        }
        return origins.get(need)

    def _entrypoint_origin(self) -> str | None:
        image, build = self._userland(self.config.environment, tests_dockerfile=False)
        dockerfile = self._entrypoint_dockerfile(image, build)
        return f"{dockerfile} sets ENTRYPOINT, which Harbor runs as the container starts" if dockerfile else None

    def verifier_sandbox_spec(self) -> SandboxSpec:
        """The fresh sandbox of ``environment_mode = "separate"``: [verifier.environment], else a
        copy of [environment]; built from tests/Dockerfile when there is one and no image is named."""
        ver = self.config.verifier
        env = ver.environment or self.config.environment
        mode = ver.network_mode or env.declared_network()
        hosts = ver.allowed_hosts if ver.network_mode else env.allowed_hosts
        image, build = self._userland(env, tests_dockerfile=True)
        return self._spec(env, _network(mode, hosts, self.default_network), role="verifier",
                          image=image, build=build, user=None)

    # -- episode phases ------------------------------------------------------------------
    async def setup(self, ctx: EpisodeContext) -> None:
        """Harbor's log dirs, then ``[environment.healthcheck]``: the agent starts only once it
        passes; one that never passes fails the episode (HealthcheckError), never scored 0. A
        multi-step task then sets up its first step."""
        if ctx.sandbox is not None:
            await verifier.make_log_dirs(ctx.sandbox)
            check = self.config.environment.healthcheck
            if check is not None:
                outcome = await wait_healthy(
                    ctx.sandbox,
                    Healthcheck(command=check.command, interval_s=check.interval_sec, timeout_s=check.timeout_sec,
                                start_period_s=check.start_period_sec, start_interval_s=check.start_interval_sec,
                                retries=check.retries),
                    where=f"task '{self.id}' ({self.toml_path} [environment.healthcheck])",
                )
                ctx.info["healthcheck"] = {"tries": outcome.tries, "waited_s": outcome.waited_s}
        if self.steps:
            await steps.begin(self, ctx, 0)

    async def call_tool(self, ctx: EpisodeContext, name: str, arguments: dict[str, Any]) -> ToolResult:
        if self.steps and steps.step_time_left(ctx) <= 0:
            step = steps.current(self, ctx)
            return ToolResult(f"error: the time for step '{step.name}' "
                              f"({steps.agent_timeout(self.config, step):g}s) is over; answer without a tool "
                              f"call to hand the step in", is_error=True)
        return await super().call_tool(ctx, name, arguments)

    async def next_turn(self, ctx: EpisodeContext) -> list[Message] | None:
        return await steps.next_turn(self, ctx) if self.steps else None

    async def solve(self, ctx: EpisodeContext) -> None:
        if self.steps:
            return await steps.solve(self, ctx)
        script = self.solution_dir / "solve.sh"
        if not script.is_file():
            raise NoReferenceSolution(f"task '{self.id}' has no reference solution ({script} does not exist)")
        if ctx.sandbox is None:
            raise RuntimeError(f"task '{self.id}': the reference solution needs a sandbox")
        env = resolve_env(self.config.solution.env, where=f"{self.toml_path} [solution].env")
        await ctx.sandbox.upload_dir(self.solution_dir, "/solution")
        user = self.config.agent.user
        result = await ctx.sandbox.exec(
            "bash /solution/solve.sh", env=env or None, timeout_s=self.limits.agent_timeout_s,
            **({"user": str(user)} if user is not None else {}),
        )
        ctx.info["solution"] = {
            "exit_code": result.exit_code,
            "timed_out": result.timed_out,
            "output_tail": (result.stdout + result.stderr)[-2000:],
        }

    async def verify(self, ctx: EpisodeContext) -> RewardResult:
        if self.steps:
            return await steps.verify(self, ctx)
        if self.config.verifier.environment_mode == "separate":
            return await verifier.verify_separate(self, ctx)
        if ctx.sandbox is None:
            return RewardResult.failed(f"task '{self.id}': no sandbox to verify in")
        return await verifier.run_tests(self, ctx.sandbox)

    async def teardown(self, ctx: EpisodeContext) -> None:
        """Copy the artifacts out (a multi-step task's were copied after each step)."""
        if self.steps:
            steps.close(ctx)
            return
        if ctx.sandbox is None:
            return
        gathered = await gather_artifacts(ctx.sandbox, self.config.artifacts, where=f"task '{self.id}'")
        if gathered.files or gathered.missing or gathered.errors or gathered.skipped:
            ctx.info[ARTIFACTS_KEY] = gathered.to_info()


def _limits(config: TaskConfig) -> TaskLimits:
    """A single-step task's limits are its [agent] and [verifier] timeouts. A multi-step task's
    agent phase holds every step's agent time and the verification of all steps but the last;
    its verification may have to verify every step (an agent that stops in the first)."""
    if not config.steps:
        agent_timeout = config.agent.timeout_sec
        return TaskLimits(agent_timeout_s=agent_timeout,
                          verifier_timeout_s=config.verifier.timeout_sec + VERIFY_GRACE_S,
                          command_timeout_s=min(60.0, agent_timeout))
    agent_times = [steps.agent_timeout(config, s) for s in config.steps]
    verify_time = sum(steps.verifier_timeout(config, s) + VERIFY_GRACE_S for s in config.steps)
    return TaskLimits(agent_timeout_s=sum(agent_times) + verify_time, verifier_timeout_s=verify_time,
                      command_timeout_s=min(60.0, *agent_times))


def _read_instruction(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TaskFormatError(f"{path}: cannot read instruction: {exc}") from exc
    if not text.strip():
        raise TaskFormatError(f"{path} is empty")
    return text


def load_harbor_task(task_dir: Path, *, task_id: str | None = None, source: str = "harbor",
                     ignore_dockerfile: bool = False, default_network: DefaultNetwork = "none",
                     task_class: type[HarborTask] = HarborTask) -> HarborTask:
    """Validate a task directory and load it as ``task_class``; a missing or malformed part is a
    TaskFormatError."""
    task_dir = Path(task_dir)
    if not task_dir.is_dir():
        raise TaskFormatError(f"Harbor task directory {task_dir} does not exist")
    toml = task_dir / "task.toml"
    single_step_parts = [name for name, ok in (
        ("instruction.md", (task_dir / "instruction.md").is_file()),
        ("tests/test.sh", (task_dir / "tests" / "test.sh").is_file()),
    ) if not ok]
    if not toml.is_file():
        raise TaskFormatError(f"Harbor task {task_dir} is missing {', '.join(['task.toml', *single_step_parts])}")
    config = load_task_config(toml)
    missing = steps.validate_layout(task_dir, config) if config.steps else single_step_parts
    if missing:
        raise TaskFormatError(f"Harbor task {task_dir} is missing {', '.join(missing)}")
    if config.environment.os != "linux":
        raise TaskUnsupportedError(f"{toml}: [environment].os = '{config.environment.os}' is not supported "
                                   f"(linux only)")
    separate = [f"[steps.verifier].environment_mode of step '{s.name}'" for s in config.steps or []
                if s.verifier.environment_mode == "separate"]
    if config.steps and config.verifier.environment_mode == "separate":
        separate.insert(0, "[verifier].environment_mode")
    if separate:
        raise TaskUnsupportedError(f"{toml}: {', '.join(separate)} = 'separate' in a multi-step task is not "
                                   f"supported yet (its steps verify in the agent's sandbox only)")
    instruction = (_read_instruction(task_dir / "steps" / config.steps[0].name / "instruction.md") if config.steps
                   else _read_instruction(task_dir / "instruction.md"))
    if config.unknown_keys:
        log.warning("%s: ignoring keys this reader does not know: %s", toml, ", ".join(config.unknown_keys))
    return task_class(task_dir, config, instruction, task_id=task_id, source=source,
                      ignore_dockerfile=ignore_dockerfile, default_network=default_network)
