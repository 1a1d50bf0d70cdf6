"""Registers the ``nemo-gym`` environment."""

from __future__ import annotations

from miles_engine import hookimpl
from miles_engine.components import Component

from miles_env_nemo_gym.options import NemoGymOptions
from miles_env_nemo_gym.source import NemoGymSource


def make_nemo_gym(options: NemoGymOptions) -> NemoGymSource:
    return NemoGymSource(options)


@hookimpl
def miles_register_environments() -> list[Component]:
    return [
        Component(
            "nemo-gym",
            make_nemo_gym,
            options=NemoGymOptions,
            description="NeMo Gym resources server over HTTP (seed_session, tool routes, verify) with JSONL/HF rows",
        )
    ]
