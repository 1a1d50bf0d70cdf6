"""Registers the ``dataset`` environment."""

from __future__ import annotations

from miles_engine import hookimpl
from miles_engine.components import Component

from miles_env_dataset.options import DatasetEnvOptions
from miles_env_dataset.source import DatasetSource


def make_dataset(options: DatasetEnvOptions) -> DatasetSource:
    return DatasetSource(options)


@hookimpl
def miles_register_environments() -> list[Component]:
    return [Component("dataset", make_dataset, options=DatasetEnvOptions,
                      description="tasks from a local JSONL / Parquet / Arrow file or save_to_disk directory "
                                  "(Hugging Face datasets), optionally sandboxed with a test command")]
