"""What a reward component is: ``async score(episode) -> RewardResult``.

``episode`` is the :class:`~miles_engine.environments.protocol.EpisodeContext` of a finished
episode, scored *before* its sandbox is closed: ``episode.task`` (id, metadata such as a
reference answer), ``episode.sandbox`` (``None`` for sandbox-less tasks), ``episode.transcript``
(OpenAI chat messages) and ``episode.info``.

Rules every component follows (checked by :class:`miles_engine.testing.reward.RewardContract`):

- return a :class:`RewardResult`; a finite ``reward``, or ``reward=None`` with ``error`` saying why;
- never raise for a bad episode (garbage transcript, missing metadata, broken sandbox): a
  verifier that cannot score returns ``RewardResult.failed(...)``;
- set ``deterministic = True`` only when the same episode always gets the same result.

Optional: ``async aclose()`` releases what the component holds (an engine, an HTTP client).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from miles_engine.environments.protocol import EpisodeContext, RewardResult


@runtime_checkable
class RewardFunction(Protocol):
    async def score(self, episode: EpisodeContext) -> RewardResult: ...


def describe_error(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
