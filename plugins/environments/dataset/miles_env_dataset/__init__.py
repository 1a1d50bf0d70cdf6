"""The ``dataset`` environment: one task per row of a local data file (see :mod:`.source`)."""

from miles_env_dataset.fields import FieldMap, TaskSpec
from miles_env_dataset.options import DatasetEnvOptions
from miles_env_dataset.source import DatasetSource

__all__ = ["DatasetEnvOptions", "DatasetSource", "FieldMap", "TaskSpec"]
