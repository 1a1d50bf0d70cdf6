"""Evaluation during training. The driver calls two verbs, whatever the mode::

    await evaluator.after_step(step, version)   # after the step's weights (version) are pushed
    ...
    await evaluator.aclose()                    # waits for queued evaluations, then stops

- ``shared``: the training engines evaluate now; new training submissions pause, then resume.
  The episodes in flight finish beside the eval, or are retracted (``eval.in_flight``; by default
  under ``fully_async``): their groups go back to the queue under the same ids. Training waits: lag 0.
- ``dedicated``: a snapshot of the step's weights is queued; a separate engine group
  (``eval.engine``: any kind the ``engines`` section builds) loads it and evaluates while training
  goes on. A full queue waits (``backpressure``) or drops that
  step's evaluation (``skip``, counted in ``eval/skipped``).
- ``external``: a hard-linked copy of the step's checkpoint is queued; a command evaluates it.

Every evaluation writes ``RUN_DIR/eval/step_NNNNNN.jsonl`` (one line per attempt, with the
step and weight version) and one ``kind="eval"`` metrics row at the step whose weights it
scored, with ``eval/weight_version`` and ``eval/lag_steps`` (training steps finished meanwhile).
A failed evaluation is logged (``eval/failed``) and never stops training.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_engine.checkpoint import consumed
from miles_engine.checkpoint.store import checkpoint_dir
from miles_engine.errors import ConfigError
from miles_engine.evaluation.config import EvalConfig
from miles_engine.evaluation.external import link_copy, parse_result, run_command
from miles_engine.evaluation.policy import ServedPolicy
from miles_engine.evaluation.runner import AttemptRecord, eval_path, run_eval, summary_metrics, write_records
from miles_engine.evaluation.splits import EvalTasks, check_disjoint, runnable_eval_tasks, select_eval_tasks

log = logging.getLogger(__name__)
Outcome = tuple[list[AttemptRecord], dict[str, float]]


@dataclass
class _Job:
    step: int
    version: int
    run: Callable[[], Awaitable[Outcome]]
    queued_at: float
    cleanup: Callable[[], None] | None = None


class Evaluator:
    """Decides when to evaluate, runs or queues the evaluation, records and logs its result."""

    def __init__(self, cfg: EvalConfig, run_dir: Path, *, log_metrics: Callable[..., Any] | None = None,
                 current_step: Callable[[], int] = lambda: 0,
                 prepare: Callable[[int, int], Awaitable[_Job]] | None = None, inline: bool = True,
                 closers: list[Callable[[], Awaitable[None]]] | None = None) -> None:
        self.cfg, self.run_dir = cfg, run_dir
        self.enabled = cfg.every is not None and prepare is not None
        self._log = log_metrics
        self._current_step = current_step
        self._prepare = prepare
        self._inline = inline
        self._closers = closers or []
        self._first = True
        self._queue: asyncio.Queue[_Job] = asyncio.Queue(maxsize=cfg.queue_size)
        self._worker: asyncio.Task[None] | None = None
        self.skipped = 0
        self.failed = 0
        self.blocked_s = 0.0
        self.rows: list[dict[str, Any]] = []  # the metrics of each evaluation, in completion order

    @classmethod
    def disabled(cls, cfg: EvalConfig, run_dir: Path) -> Evaluator:
        return cls(cfg, run_dir)

    def due(self, step: int) -> bool:
        first, self._first = self._first, False
        if not self.enabled or eval_path(self.run_dir, step).exists():  # a resumed run: evaluated already
            return False
        return (first and self.cfg.at_start) or (step > 0 and step % self.cfg.every == 0)  # type: ignore[operator]

    async def after_step(self, step: int, version: int) -> None:
        if not self.due(step):
            return
        assert self._prepare is not None
        job = await self._prepare(step, version)
        if self._inline:
            await self._run(job)
            return
        if self._queue.full() and self.cfg.overflow == "skip":
            self.skipped += 1
            if job.cleanup is not None:
                job.cleanup()
            log.warning("eval: step %d skipped (eval queue full, eval.overflow: skip; %d skipped)", step, self.skipped)
            return
        if self._worker is None:
            self._worker = asyncio.create_task(self._work(), name="eval-worker")
        t0 = time.monotonic()
        await self._queue.put(job)  # backpressure: training waits for a free slot
        self.blocked_s += time.monotonic() - t0

    async def _work(self) -> None:
        while True:
            job = await self._queue.get()
            try:
                await self._run(job)
            finally:
                self._queue.task_done()

    async def _run(self, job: _Job) -> None:
        started = time.monotonic()
        metrics: dict[str, float]
        records: list[AttemptRecord] = []
        try:
            records, extra = await job.run()
            metrics = {**summary_metrics(records, self.cfg), **extra} if records else dict(extra)
            metrics["eval/failed"] = 0.0
        except Exception as exc:  # noqa: BLE001 - an evaluation that fails must not stop training
            self.failed += 1
            log.warning("eval of step %d failed: %s: %s", job.step, type(exc).__name__, exc)
            print(f"warning: eval of step {job.step} failed: {type(exc).__name__}: {exc}")
            metrics = {"eval/failed": 1.0}
        finally:
            if job.cleanup is not None:
                job.cleanup()
        mismatched = sum(1 for r in records if r.weight_versions and r.weight_versions != [job.version])
        lag = self._current_step() - job.step
        metrics.update({"eval/weight_version": float(job.version), "eval/lag_steps": float(lag),
                        "eval/seconds": time.monotonic() - started, "eval/queue_wait_s": started - job.queued_at,
                        "eval/version_mismatched_attempts": float(mismatched), "eval/skipped": float(self.skipped),
                        "eval/backpressure_s": self.blocked_s})
        if records:
            write_records(eval_path(self.run_dir, job.step), records, step=job.step, weight_version=job.version,
                          lag_steps=lag, mode=self.cfg.mode)
        self.rows.append({"step": job.step, **metrics})
        if self._log is not None:
            self._log(job.step, metrics, kind="eval")
        if "eval/reward" in metrics:
            print(f"eval step {job.step} (weights v{job.version}, lag {lag}): reward {metrics['eval/reward']:.3f} "
                  f"[{metrics['eval/reward_ci_low']:.3f}, {metrics['eval/reward_ci_high']:.3f}], pass@1 "
                  f"{metrics.get('eval/pass@1', float('nan')):.3f} over {int(metrics['eval/tasks_scored'])} tasks, "
                  f"{int(metrics['eval/errors'])} errors")

    async def aclose(self, *, drain: bool = True) -> None:
        """Finish the queued evaluations (bounded by the eval timeout), then stop the worker and
        whatever the mode started (dedicated engine and session server)."""
        try:
            if drain and self._worker is not None and not self._worker.done():
                limit = (self.cfg.timeout_s or 600.0) * (self._queue.qsize() + 1) + 60
                try:
                    async with asyncio.timeout(limit):
                        await self._queue.join()
                except TimeoutError:
                    log.warning("eval: queued evaluations did not finish within %.0fs; cancelled", limit)
        finally:
            if self._worker is not None:
                self._worker.cancel()
                await asyncio.gather(self._worker, return_exceptions=True)
            while not self._queue.empty():
                job = self._queue.get_nowait()
                if job.cleanup is not None:
                    job.cleanup()
            for close in reversed(self._closers):
                await close()
            self._closers = []


# ---------------------------------------------------------------------- built from a training run
@dataclass(frozen=True)
class EvalInputs:
    """What the evaluator uses from the run, and nothing else."""

    cfg: Any  # RecipeConfig
    run_dir: Path
    hub: Any
    source: Any
    tasks: Any  # the training TaskStream (eval tasks must not be among them)
    backend: Any  # the sandbox backend
    reward: Any
    metrics: Any
    scheduler: Any  # shared mode pauses new training submissions
    server: Any  # the session server in front of the training engines
    model: Any  # the policy the run started from (dedicated mode serves a copy)
    codec: Any
    trainer: Any  # TrainerAccess: weight snapshots for dedicated mode
    progress: Any  # .step: the step the run is at (lag of a finished eval)

    @property
    def step(self) -> int:
        return int(self.progress.step)


def _agent_factory(inputs: Any, url: str) -> Callable[[], Any]:
    cfg = inputs.cfg
    overrides = {k: v for k, v in cfg.eval.sampling.model_dump().items() if v is not None}
    options = {**cfg.agent.options, "server_url": url, **overrides}
    return lambda: inputs.hub.create("agent", cfg.agent.name, options, where="agent.options")


def shared_in_flight(cfg: EvalConfig, rollout_mode: str) -> str:
    """What shared evaluation does with the training episodes in flight: finish or retract."""
    if cfg.in_flight != "auto":
        return cfg.in_flight
    return "retract" if rollout_mode == "fully_async" else "finish"


def trained_task_ids(run_dir: Path) -> set[str]:
    """The tasks of every group a resumed run has trained on so far."""
    return {gid.rsplit("@", 1)[0] for row in consumed.read(run_dir) for gid in row.get("groups", [])}


def _eval_tasks(inputs: Any, closers: list[Callable[[], Awaitable[None]]]) -> EvalTasks:
    cfg = inputs.cfg.eval
    if cfg.environment is None:
        tasks = select_eval_tasks(cfg, inputs.source, from_training_env=True)
    else:
        from miles_engine.environments.capabilities import close_environment

        source = inputs.hub.create("environment", cfg.environment.name, cfg.environment.options,
                                  where="eval.environment.options")
        closers.append(lambda: close_environment(source))
        tasks = select_eval_tasks(cfg, source, from_training_env=False)
    if tasks.source.name == inputs.source.name:
        check_disjoint((r.id for r in inputs.tasks.refs), tasks.ids, environment=inputs.source.name)
        check_disjoint(trained_task_ids(inputs.run_dir), tasks.ids, environment=inputs.source.name,
                       what="tasks this run already trained on (consumed.jsonl)")
    tasks = runnable_eval_tasks(tasks, inputs.cfg.sandbox.backend, inputs.backend)
    print(f"eval: {tasks.describe()}; {len(inputs.tasks)} training task(s), none of them evaluated; "
          f"{cfg.attempts} attempt(s) each, mode {cfg.mode}, every {cfg.every} step(s)")
    return tasks


async def build_evaluator(inputs: EvalInputs) -> Evaluator:
    """The evaluator of a training run (a disabled one when ``eval.every`` is unset)."""
    cfg: EvalConfig = inputs.cfg.eval
    if cfg.every is None:
        return Evaluator.disabled(cfg, inputs.run_dir)
    closers: list[Callable[[], Awaitable[None]]] = []
    reward = inputs.reward if cfg.environment is None else None
    common = dict(log_metrics=inputs.metrics.log, current_step=lambda: inputs.step, closers=closers)
    if cfg.mode == "external":
        every, ckpt = cfg.every, inputs.cfg.run.checkpoint_every
        if not ckpt or every % ckpt:
            raise ConfigError(f"eval.mode: external evaluates checkpoints, so eval.every ({every}) must be a multiple "
                              f"of run.checkpoint_every ({ckpt})")
        return Evaluator(cfg, inputs.run_dir, prepare=_external(inputs), inline=False, **common)
    tasks = _eval_tasks(inputs, closers)
    if cfg.mode == "shared":
        make_agent = _agent_factory(inputs, inputs.server.url)
        retract = shared_in_flight(cfg, inputs.cfg.rollout.mode) == "retract"

        async def prepare_shared(step: int, version: int) -> _Job:
            async def run() -> Outcome:
                inputs.scheduler.pause()  # new training groups wait
                try:  # the running ones finish beside the eval, or go back to the queue
                    retracted = await inputs.scheduler.retract() if retract else 0
                    records = await run_eval(tasks, make_agent, inputs.backend, cfg, reward=reward)
                    return records, {"eval/retracted_groups": float(retracted)}
                finally:
                    inputs.scheduler.resume()
            return _Job(step, version, run, time.monotonic())

        return Evaluator(cfg, inputs.run_dir, prepare=prepare_shared, inline=True, **common)
    served = await ServedPolicy.start(inputs.model, inputs.codec, inputs.cfg, hub=inputs.hub,
                                      state_dir=inputs.run_dir / "eval" / "engines", restore=inputs.trainer.last_pushed)
    closers.append(served.aclose)
    print(f"eval: dedicated {served.kind} engine(s) at {served.url}")
    make_agent = _agent_factory(inputs, served.url)

    async def prepare_dedicated(step: int, version: int) -> _Job:
        snapshot = {n: t.detach().clone() for n, t in await inputs.trainer.named_tensors()}

        async def run() -> Outcome:
            await served.load(snapshot, version)
            return await run_eval(tasks, make_agent, inputs.backend, cfg, reward=reward), {}
        return _Job(step, version, run, time.monotonic())

    return Evaluator(cfg, inputs.run_dir, prepare=prepare_dedicated, inline=False, **common)


def _external(inputs: Any) -> Callable[[int, int], Awaitable[_Job]]:
    cfg = inputs.cfg.eval
    assert cfg.external is not None
    eval_dir = inputs.run_dir / "eval"
    tasks_file = eval_dir / "tasks.json"
    if cfg.environment is None and cfg.split_method != "none":  # the held-out ids, for the command to use
        eval_dir.mkdir(parents=True, exist_ok=True)
        held_out = select_eval_tasks(cfg, inputs.source, from_training_env=True)
        tasks_file.write_text(json.dumps({"environment": inputs.source.name, "split": held_out.split,
                                          "task_ids": held_out.ids}))

    async def prepare(step: int, version: int) -> _Job:
        source = checkpoint_dir(inputs.run_dir) / f"step_{step:08d}"
        work = eval_dir / f".external-step_{step:06d}"
        shutil.rmtree(work, ignore_errors=True)
        if source.is_dir():
            link_copy(source, work / source.name)
        else:
            work.mkdir(parents=True)
        values = {"checkpoint": str(work / source.name), "step": str(step), "run_dir": str(inputs.run_dir),
                  "output": str(work / "result.json"), "tasks": str(tasks_file)}

        async def run() -> Outcome:
            if not source.is_dir():
                raise FileNotFoundError(f"no checkpoint {source} to evaluate")
            result = await run_command(cfg.external.command, values, cfg.external.timeout_s)
            (eval_dir / f"external_step_{step:06d}.json").write_text(json.dumps(result))
            return parse_result(result, cfg.success_threshold)

        return _Job(step, version, run, time.monotonic(), cleanup=lambda: shutil.rmtree(work, ignore_errors=True))

    return prepare
