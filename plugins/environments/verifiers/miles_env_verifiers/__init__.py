"""miles environment plugin for Prime Intellect verifiers tasksets (verifiers 0.4.0, ``verifiers.v1``)."""

from miles_env_verifiers.plugin import VerifiersOptions
from miles_env_verifiers.scoring import build_trace, score_episode
from miles_env_verifiers.source import VerifiersSource
from miles_env_verifiers.task import VerifiersTask

__all__ = ["VerifiersOptions", "VerifiersSource", "VerifiersTask", "build_trace", "score_episode"]
