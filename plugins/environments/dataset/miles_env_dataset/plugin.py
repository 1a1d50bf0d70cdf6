"""Registers the ``dataset`` environment."""

from __future__ import annotations

from miles_engine import hookimpl
from miles_engine.components import Component


def make_dataset(options):  # noqa: ANN001, ANN201 - typed by the Component's options model
    from miles_env_dataset.source import DatasetSource

    return DatasetSource(options)


@hookimpl
def miles_register_environments() -> list[Component]:
    try:
        from miles_env_dataset.options import DatasetEnvOptions
    except ModuleNotFoundError as exc:  # a miles-engine without miles_engine.data (older core in this venv)
        if exc.name and exc.name.startswith("miles_engine"):
            return []
        raise
    return [Component("dataset", make_dataset, options=DatasetEnvOptions,
                      description="tasks from a local JSONL / Parquet / Arrow file or save_to_disk directory "
                                  "(Hugging Face datasets), optionally sandboxed with a test command")]
