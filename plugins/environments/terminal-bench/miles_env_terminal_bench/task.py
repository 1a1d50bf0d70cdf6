"""One terminal-bench 1.x task directory as a miles task.

Layout (terminal-bench's)::

    task.yaml                 instruction, difficulty, timeouts, parser (see config.py)
    run-tests.sh              the test entry point; copied to /tests with tests/ at grading time
    tests/                    usually test_outputs.py (pytest)
    solution.sh | solution.yaml   the reference solution
    Dockerfile, docker-compose.yaml   the container (→ SandboxSpec.build)

Grading, as terminal-bench does it: copy ``run-tests.sh`` and ``tests/`` into ``/tests``, run
``bash /tests/run-tests.sh`` with ``TEST_DIR=/tests`` under ``max_test_timeout_sec``, read its
output with the task's ``parser_name`` (:mod:`miles_env_terminal_bench.graders`); reward 1.0 iff
every test passed and at least one ran.

``run_tests_in_same_shell``: terminal-bench then runs the tests in the agent's own shell session,
so what the agent's commands left in that shell (exported variables, the working directory)
reaches ``run-tests.sh``. Each ``exec`` here is a fresh shell, so the agent's shell is kept in a
state file instead: each ``bash`` call starts from it and writes it back on exit (the
``solution.yaml`` keystrokes too), and the tests start from it. Otherwise the tests run in a fresh
shell at the task's working directory, as terminal-bench runs them in a new session.
"""

from __future__ import annotations

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
from miles_engine.errors import TaskFormatError
from miles_engine.sandbox.protocol import BuildContext, NetworkPolicy, Resources, SandboxSpec

from miles_env_terminal_bench.compose import (
    CLIENT_CONTAINER_VAR,
    agent_service,
    load_client,
    load_services,
    read_services,
)
from miles_env_terminal_bench.config import TBTaskConfig, load_solution_yaml, load_task_yaml
from miles_env_terminal_bench.graders import expected, grade

Network = Literal["none", "public"]
TASK_PATHS: tuple[str, ...] = ("/app", "/logs", "/tests", "/solution")
TEST_OUTPUT = "/logs/tests-output.txt"
PREPARE_TESTS = f"mkdir -p /tests /logs && rm -f {TEST_OUTPUT}"
RUN_TESTS = f"bash /tests/run-tests.sh > {TEST_OUTPUT} 2>&1"
READ_OUTPUT = f"tail -c 262144 {TEST_OUTPUT}"
VERIFY_GRACE_S = 30.0
SHELL_STATE = "/tmp/.miles-agent-shell"  # the agent's shell between calls (run_tests_in_same_shell)
RESTORE_SHELL = f'[ -r {SHELL_STATE} ] && . {SHELL_STATE}\n'
SAVE_SHELL_ON_EXIT = f"trap '{{ export -p; printf \"cd %q\\n\" \"$PWD\"; }} > {SHELL_STATE} 2>/dev/null' EXIT\n"
_TMUX_KEY = re.compile(r"^(?:[CMS]-.+|Escape|Enter|Tab|BSpace|BTab|Up|Down|Left|Right|Home|End|PPage|NPage|F\d+)$")


class TerminalBenchTask(SandboxTask):
    """A terminal-bench task. Build one with :func:`load_tb_task` (which validates the directory)."""

    def __init__(self, task_dir: Path, config: TBTaskConfig, *, task_id: str | None = None,
                 source: str = "terminal-bench", ignore_dockerfile: bool = False, network: Network = "none"):
        limits = TaskLimits(
            agent_timeout_s=config.max_agent_timeout_sec,
            verifier_timeout_s=config.max_test_timeout_sec + VERIFY_GRACE_S,
            command_timeout_s=min(60.0, config.max_agent_timeout_sec),
        )
        metadata: dict[str, Any] = {
            "source": source,
            "path": str(task_dir),
            "format": "terminal-bench",
            "difficulty": config.difficulty,
            "category": config.category,
            "tags": list(config.tags),
        }
        super().__init__(task_id or task_dir.name, limits=limits, metadata=metadata)
        self.task_dir = task_dir
        self.config = config
        self.ignore_dockerfile = ignore_dockerfile
        self.network: Network = network
        self.compose_file = task_dir / "docker-compose.yaml"
        self.services = list(read_services(self.compose_file)) if self.compose_file.is_file() else []

    def prompt(self) -> list[Message]:
        return [{"role": "user", "content": self.config.prompt_text}]

    def sandbox_spec(self) -> SandboxSpec:
        build, image, env, workdir, sidecars, volumes = None, None, {}, "/app", (), ()
        resources = Resources()
        if not self.ignore_dockerfile:
            compose = self.compose_file
            if compose.is_file():
                service = agent_service(compose, self.id)
                client = load_client(compose, self.id, service)
                if client.context_dir is not None:
                    build = BuildContext(context_dir=client.context_dir, dockerfile=client.dockerfile)
                image, env, workdir = client.image, client.env, client.workdir or workdir
                loaded = load_services(compose, self.id, client=service)
                sidecars, volumes = loaded.sidecars, loaded.main_volumes
                resources = loaded.main_limits.resources  # the client's cpus / mem_limit
            elif (self.task_dir / "Dockerfile").is_file():
                build = BuildContext(context_dir=self.task_dir)
        return SandboxSpec(
            image=image,
            build=build,
            workdir=workdir,
            paths=TASK_PATHS if workdir in TASK_PATHS else (*TASK_PATHS, workdir),
            env=env,
            network=NetworkPolicy(mode=self.network),
            resources=resources,
            labels={"miles.source": str(self.metadata["source"]), "miles.task": self.id},
            services=sidecars,
            volumes=volumes,
        )

    def need_origin(self, need: str) -> str | None:
        """Where this task asks for a sandbox need (an ``UnmetNeed.field``): the file and key."""
        compose = self.compose_file if self.compose_file.is_file() and not self.ignore_dockerfile else None
        service = agent_service(compose, self.id) if compose is not None else None
        if need == "network":
            return f"the environment's option network = '{self.network}' (task.yaml declares none)"
        if need == "paths":
            return f"terminal-bench's task layout ({', '.join(TASK_PATHS)})"
        if compose is None:
            return f"{self.task_dir / 'Dockerfile'} (or ignore_dockerfile=true)" if need == "build" else None
        agent = f"{compose} services.{service}"
        return {"build": f"{agent}.build (or ignore_dockerfile=true)", "image": f"{agent}.image",
                "services": f"{compose} (services besides '{service}', the agent's: its container_name is "
                            f"${{{CLIENT_CONTAINER_VAR}}} or its name is 'client')",
                "volumes": f"{agent}.volumes", "cpus": f"{agent} cpus / deploy.resources.limits",
                "memory": f"{agent} mem_limit / deploy.resources.limits"}.get(need)

    async def call_tool(self, ctx: EpisodeContext, name: str, arguments: dict[str, Any]) -> ToolResult:
        command = arguments.get("command")
        if self.config.run_tests_in_same_shell and name == "bash" and isinstance(command, str) and command.strip():
            arguments = {**arguments, "command": RESTORE_SHELL + SAVE_SHELL_ON_EXIT + command}
        return await super().call_tool(ctx, name, arguments)

    def _solution_script(self) -> bytes:
        sh = self.task_dir / "solution.sh"
        if sh.is_file():
            return sh.read_bytes()
        yml = self.task_dir / "solution.yaml"
        if not yml.is_file():
            raise NoReferenceSolution(f"task '{self.id}' has no reference solution (no solution.sh or solution.yaml)")
        keys: list[str] = []
        for step in load_solution_yaml(yml):
            if _TMUX_KEY.match(step.command.strip()):
                raise NoReferenceSolution(
                    f"task '{self.id}': solution.yaml sends the tmux key '{step.command}', "
                    f"which cannot be replayed without a terminal"
                )
            keys.append(step.command + ("\n" if step.append_enter else ""))
        return "".join(keys).encode()

    async def solve(self, ctx: EpisodeContext) -> None:
        """Run solution.sh; solution.yaml keystrokes are fed, in order, to one shell's stdin
        (programs they start read the following lines, as from a terminal; block and
        min_timeout_sec are not needed without tmux)."""
        script = self._solution_script()
        if ctx.sandbox is None:
            raise RuntimeError(f"task '{self.id}': the reference solution needs a sandbox")
        timeout = self.limits.agent_timeout_s
        if (self.task_dir / "solution.sh").is_file():
            await ctx.sandbox.write_file("/solution/solution.sh", script, mode=0o755)
            result = await ctx.sandbox.exec("bash /solution/solution.sh", timeout_s=timeout)
        else:  # keystrokes typed into the agent's shell: with run_tests_in_same_shell its state is kept
            if self.config.run_tests_in_same_shell:
                script = (RESTORE_SHELL + SAVE_SHELL_ON_EXIT).encode() + script
            result = await ctx.sandbox.exec("bash -s", stdin=script, timeout_s=timeout)
        ctx.info["solution"] = {"exit_code": result.exit_code, "timed_out": result.timed_out,
                                "output_tail": (result.stdout + result.stderr)[-2000:]}

    async def verify(self, ctx: EpisodeContext) -> RewardResult:
        where = f"task '{self.id}'"
        sb = ctx.sandbox
        if sb is None:
            return RewardResult.failed(f"{where}: no sandbox to run the tests in")
        prep = await sb.exec(PREPARE_TESTS, timeout_s=30)
        if not prep.ok:
            return RewardResult.failed(f"{where}: cannot prepare /tests: {(prep.stderr or prep.stdout).strip()}")
        if (self.task_dir / "tests").is_dir():
            await sb.upload_dir(self.task_dir / "tests", "/tests")
        await sb.write_file("/tests/run-tests.sh", (self.task_dir / "run-tests.sh").read_bytes(), mode=0o755)
        timeout = self.config.max_test_timeout_sec
        command = RESTORE_SHELL + RUN_TESTS if self.config.run_tests_in_same_shell else RUN_TESTS
        run = await sb.exec(command, env={"TEST_DIR": "/tests"}, timeout_s=timeout)
        output = (await sb.exec(READ_OUTPUT, timeout_s=30)).stdout
        info: dict[str, Any] = {"test_exit_code": run.exit_code, "test_output_tail": output[-2000:]}
        if run.timed_out:
            return RewardResult.failed(f"{where}: run-tests.sh timed out after {timeout:g}s", **info)
        parser = self.config.parser_name
        summary = grade(parser, output)
        if summary is None:
            return RewardResult.failed(
                f"{where}: cannot parse the output of run-tests.sh with parser_name '{parser}' "
                f"({expected(parser)}; exit code {run.exit_code})", **info)
        info.update(parsed_from=summary.source, tests=summary.tests)
        return RewardResult(
            reward=1.0 if summary.resolved else 0.0,
            components={"pass_fraction": summary.pass_fraction, "passed": float(summary.passed),
                        "failed": float(summary.failed)},
            info=info,
        )


def load_tb_task(task_dir: Path, *, task_id: str | None = None, source: str = "terminal-bench",
                 ignore_dockerfile: bool = False, network: Network = "none") -> TerminalBenchTask:
    """Validate a task directory and load it; a missing or malformed part is a TaskFormatError."""
    task_dir = Path(task_dir)
    if not task_dir.is_dir():
        raise TaskFormatError(f"terminal-bench task directory {task_dir} does not exist")
    missing = [n for n in ("task.yaml", "run-tests.sh") if not (task_dir / n).is_file()]
    if missing:
        raise TaskFormatError(f"terminal-bench task {task_dir} is missing {', '.join(missing)}")
    if (task_dir / "tests").exists() and not (task_dir / "tests").is_dir():
        raise TaskFormatError(f"terminal-bench task {task_dir}: tests must be a directory")
    config = load_task_yaml(task_dir / "task.yaml")
    if not config.prompt_text.strip():
        raise TaskFormatError(f"{task_dir / 'task.yaml'}: field 'instruction' is empty")
    return TerminalBenchTask(task_dir, config, task_id=task_id, source=source,
                             ignore_dockerfile=ignore_dockerfile, network=network)
