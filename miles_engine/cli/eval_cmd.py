"""``miles eval RECIPE``: run the recipe's agent on its environment's tasks and report rewards."""

from __future__ import annotations

import asyncio
import statistics
import sys

import click

from miles_engine.cli.common import cli_hub, console, echo_json, table
from miles_engine.config.recipe import RecipeConfig, load_recipe
from miles_engine.environments.capabilities import close_environment, preflight
from miles_engine.rewards.stack import build_reward_stack
from miles_engine.rollout.episode import EpisodeResult, run_episode


async def _evaluate(hub: Hub, cfg: RecipeConfig) -> list[EpisodeResult]:
    reward = build_reward_stack(hub, cfg.reward)  # components acquire resources lazily: nothing to close yet
    source = hub.create("environment", cfg.environment.name, cfg.environment.options, where="environment.options")
    backend = hub.create("sandbox", cfg.sandbox.backend, cfg.sandbox.options, where="sandbox.options")
    try:
        preflight(source, cfg.sandbox.backend, backend)
    except BaseException:
        await backend.aclose()
        await close_environment(source)
        raise
    ids = cfg.eval.tasks or [ref.id for ref in source.list_tasks()]
    if cfg.eval.limit:
        ids = ids[: cfg.eval.limit]
    gate = asyncio.Semaphore(cfg.eval.jobs)

    async def one(task_id: str) -> EpisodeResult:
        async with gate:
            agent = hub.create("agent", cfg.agent.name, cfg.agent.options, where="agent.options")
            return await run_episode(source.load_task(task_id), agent, backend, reward=reward)

    try:
        return list(await asyncio.gather(*(one(t) for t in ids for _ in range(cfg.eval.attempts))))
    finally:
        if reward is not None:
            await reward.aclose()
        await backend.aclose()
        await close_environment(source)


@click.command("eval")
@click.argument("recipe")
@click.argument("overrides", nargs=-1)
@click.option("--json", "as_json", is_flag=True)
def eval_cmd(recipe: str, overrides: tuple[str, ...], as_json: bool) -> None:
    """Evaluate RECIPE's agent on its environment (KEY=VALUE overrides, e.g. eval.jobs=8)."""
    hub = cli_hub()
    cfg = load_recipe(recipe, list(overrides), hub)
    results = asyncio.run(_evaluate(hub, cfg))
    scored = [r.reward.reward for r in results if r.reward.reward is not None]
    mean = statistics.fmean(scored) if scored else float("nan")
    errors = [r for r in results if r.reward.error]
    if as_json:
        echo_json({"mean_reward": mean, "episodes": [r.to_dict() for r in results]})
    else:
        console().print(table(None, ["task", "reward", "turns", "stop", "error"],
                              ([r.task_id, r.reward.reward, r.agent.turns, r.agent.stop_reason, r.reward.error or ""]
                               for r in results)))
        click.echo(f"mean reward {mean:.3f} over {len(scored)} scored episodes; {len(errors)} errors")
    if not results:
        sys.exit(1)
