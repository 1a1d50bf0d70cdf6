"""Task directories are data: their Python files (e.g. a task's own failing unit tests) are
inputs for agents, never tests of this repository."""

collect_ignore_glob = ["miles_env_terminal_tasks/tasks/*"]
