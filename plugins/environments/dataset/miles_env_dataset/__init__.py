"""The ``dataset`` environment: one task per row of a local data file (see :mod:`.source`).

Import ``DatasetSource`` from :mod:`miles_env_dataset.source` and the options from
:mod:`miles_env_dataset.options` (this package imports nothing, so the plugin's entry point
loads on any core)."""
