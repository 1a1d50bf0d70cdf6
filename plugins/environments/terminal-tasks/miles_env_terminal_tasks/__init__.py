"""miles environment plugin: packaged terminal tasks (Harbor format) and shell drills.

- ``terminal-tasks``: small Harbor task directories shipped in ``tasks/`` that run on the local
  sandbox without Docker (see :mod:`miles_env_terminal_tasks.packaged`).
- ``shell-drills``: unlimited seeded drills (echo, calc, write-file, count, grep) with reference
  solutions and noisy demonstrations (see :mod:`miles_env_terminal_tasks.drills`).
"""

from miles_env_terminal_tasks.drills import DrillOptions, ShellDrillsSource
from miles_env_terminal_tasks.packaged import TASKS_DIR, PackagedTask, PackagedTaskSource, packaged_source

__all__ = ["TASKS_DIR", "DrillOptions", "PackagedTask", "PackagedTaskSource", "ShellDrillsSource", "packaged_source"]
