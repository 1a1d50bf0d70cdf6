"""``miles eval``: a recipe's agent over its eval task set, or checkpoints' weights behind it.

``evaluate(hub, cfg)`` runs the recipe's agent as configured. ``evaluate_checkpoints(hub, cfg,
paths)`` builds the recipe's policy (codec and model as training built them), serves it on an
embedded engine and evaluates each checkpoint's weights on the same tasks; :func:`compare`
is the paired difference of two of them over those tasks.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_engine.checkpoint.export import read_policy
from miles_engine.checkpoint.resume import tokenizer_sha256
from miles_engine.config.recipe import RecipeConfig
from miles_engine.errors import ConfigError
from miles_engine.evaluation.policy import ServedPolicy
from miles_engine.evaluation import stats
from miles_engine.evaluation.runner import AttemptRecord, per_task_values, run_eval, summary_metrics
from miles_engine.evaluation.splits import EvalTasks, runnable_eval_tasks, select_eval_tasks
from miles_engine.hub import Hub
from miles_engine.rollout.parts import agent_factory, open_environment, open_reward, open_sandboxes
from miles_engine.run.policy import build_codec, build_policy


@dataclass
class EvalRun:
    label: str
    records: list[AttemptRecord]
    metrics: dict[str, float]
    step: int | None = None
    weight_version: int | None = None
    info: dict[str, Any] = field(default_factory=dict)


@contextlib.asynccontextmanager
async def _environment(hub: Hub, cfg: RecipeConfig) -> AsyncIterator[tuple[Any, EvalTasks, Any, Any]]:
    """The training source, the eval task set, the sandbox backend and the reward stack; all closed after."""
    async with AsyncExitStack() as stack:
        source = open_environment(hub, cfg.environment, stack)
        backend = open_sandboxes(hub, cfg.sandbox, stack)
        reward = None
        if cfg.eval.environment is None:
            reward = open_reward(hub, cfg.reward, stack)
            tasks = select_eval_tasks(cfg.eval, source, from_training_env=True)
        else:
            other = open_environment(hub, cfg.eval.environment, stack, key="eval.environment")
            tasks = select_eval_tasks(cfg.eval, other, from_training_env=False)
        # a task the backend cannot run is left out with its reason; the others are evaluated
        yield source, runnable_eval_tasks(tasks, cfg.sandbox.backend, backend), backend, reward


def _metrics(records: list[AttemptRecord], tasks: EvalTasks, cfg: RecipeConfig) -> dict[str, float]:
    return {**summary_metrics(records, cfg.eval), "eval/tasks_excluded": float(len(tasks.excluded))}


def _info(tasks: EvalTasks) -> dict[str, Any]:
    return {"tasks": tasks.describe(), "excluded_tasks": [e.to_dict() for e in tasks.excluded]}


def _agent_factory(hub: Hub, cfg: RecipeConfig, server_url: str | None) -> Any:
    overrides = {k: v for k, v in cfg.eval.sampling.model_dump().items() if v is not None}
    return agent_factory(hub, cfg.agent, server_url=server_url, overrides=overrides)


async def evaluate(hub: Hub, cfg: RecipeConfig) -> EvalRun:
    async with _environment(hub, cfg) as (_, tasks, backend, reward):
        records = await run_eval(tasks, _agent_factory(hub, cfg, None), backend, cfg.eval, reward=reward)
    return EvalRun(cfg.agent.name, records, _metrics(records, tasks, cfg), info=_info(tasks))


async def evaluate_checkpoints(hub: Hub, cfg: RecipeConfig, paths: Sequence[Path]) -> list[EvalRun]:
    """Each checkpoint's weights on the same eval tasks, loaded in turn into the eval engines
    (``eval.engine``; default one embedded engine)."""
    weights = [read_policy(Path(p), label="--checkpoint") for p in paths]
    runs: list[EvalRun] = []
    async with _environment(hub, cfg) as (source, tasks, backend, reward):
        codec = build_codec(cfg, hub, source)
        sha = tokenizer_sha256(codec.tokenizer)
        for w in weights:
            if w.tokenizer_sha256 and w.tokenizer_sha256 != sha:
                raise ConfigError(f"--checkpoint {w.path}: it was trained with another tokenizer than this recipe "
                                  f"builds (sha256 {w.tokenizer_sha256[:12]}… vs {sha[:12]}…); pass the run's own "
                                  f"recipe, RUN_DIR/config.yaml")
        state_dir = Path(tempfile.mkdtemp(prefix="miles-eval-engines-"))
        try:
            served = await ServedPolicy.start(build_policy(cfg, codec), codec, cfg, hub=hub, state_dir=state_dir)
        except BaseException:
            shutil.rmtree(state_dir, ignore_errors=True)
            raise
        try:
            make_agent = _agent_factory(hub, cfg, served.url)
            for w in weights:
                await served.load(w.tensors, w.weight_version)
                records = await run_eval(tasks, make_agent, backend, cfg.eval, reward=reward)
                metrics = _metrics(records, tasks, cfg)
                metrics["eval/weight_version"] = float(w.weight_version)
                runs.append(EvalRun(str(w.path), records, metrics, w.step, w.weight_version, info=_info(tasks)))
        finally:
            await served.aclose()
            shutil.rmtree(state_dir, ignore_errors=True)
    return runs


def compare(after: EvalRun, before: EvalRun, cfg: RecipeConfig) -> dict[str, stats.Estimate]:
    """``after - before`` of per-task reward and pass@1, paired over the tasks both scored."""
    return {metric: stats.paired_difference(per_task_values(after.records, metric),
                                            per_task_values(before.records, metric),
                                            resamples=cfg.eval.bootstrap_resamples, seed=cfg.eval.seed)
            for metric in ("reward", "pass@1")}
