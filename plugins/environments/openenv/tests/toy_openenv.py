"""A toy OpenEnv environment built with OpenEnv's own types and ``create_app``: guess a number.

reset(seed) picks the secret ``seed % 10``; each ``step({"guess": n})`` answers higher/lower/correct;
a correct guess gives reward 1 and ends the episode, and the episode also ends after 4 guesses.
"""

from __future__ import annotations

import uuid
from typing import Any

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, EnvironmentMetadata, Observation, State
from pydantic import Field

MAX_GUESSES = 4


class GuessAction(Action):
    """A guess of the secret number."""

    guess: int = Field(ge=0, le=9, description="your guess, 0-9")


class GuessObservation(Observation):
    hint: str = ""
    guesses_left: int = MAX_GUESSES


class GuessState(State):
    secret: int = 0


class GuessEnvironment(Environment[GuessAction, GuessObservation, GuessState]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = GuessState(episode_id=str(uuid.uuid4()), step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        self._state = GuessState(episode_id=episode_id or str(uuid.uuid4()), step_count=0, secret=(seed or 0) % 10)
        return GuessObservation(hint="guess a number from 0 to 9", guesses_left=MAX_GUESSES)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        if action.guess == 7 and self._state.secret == 3:
            raise RuntimeError("the toy environment refuses 7 when the secret is 3")
        self._state.step_count += 1
        left = MAX_GUESSES - self._state.step_count
        if action.guess == self._state.secret:
            return GuessObservation(hint="correct", guesses_left=left, reward=1.0, done=True)
        hint = "higher" if action.guess < self._state.secret else "lower"
        return GuessObservation(hint=hint, guesses_left=left, reward=0.0, done=left <= 0)

    @property
    def state(self) -> GuessState:
        return self._state

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(name="guess", description="guess the secret number from hints")


def make_app(max_concurrent_envs: int = 8) -> Any:
    return create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess",
                      max_concurrent_envs=max_concurrent_envs)


app = make_app()
