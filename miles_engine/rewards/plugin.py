"""Built-in plugin registering the ``task`` reward: the environment's own verifier as a stack term."""

from __future__ import annotations

from miles_engine import hookimpl
from miles_engine.components import Component
from miles_engine.environments.protocol import EpisodeContext, RewardResult
from miles_engine.rewards.config import TASK_VERIFIER


class TaskVerifier:
    """Scores with ``episode.task.verify(episode)`` (Harbor's test.sh, a terminal task's check …)."""

    deterministic = False  # a task's verifier may be anything

    async def score(self, episode: EpisodeContext) -> RewardResult:
        task = getattr(episode, "task", None)
        if task is None or not callable(getattr(task, "verify", None)):
            return RewardResult.failed("the episode has no task with a verify() method")
        return await task.verify(episode)


@hookimpl
def miles_register_rewards() -> list[Component]:
    return [Component(TASK_VERIFIER, lambda _opts: TaskVerifier(),
                      description="the environment's own verifier (what a recipe without reward.components uses)")]
