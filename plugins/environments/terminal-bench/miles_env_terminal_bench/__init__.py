"""miles environment plugin for terminal-bench 1.x task directories (read at the file-format level)."""

from miles_env_terminal_bench.config import TBTaskConfig, load_task_yaml
from miles_env_terminal_bench.parser import PytestSummary, parse_pytest_output
from miles_env_terminal_bench.source import TerminalBenchSource
from miles_env_terminal_bench.task import TerminalBenchTask, load_tb_task

__all__ = [
    "PytestSummary",
    "TBTaskConfig",
    "TerminalBenchSource",
    "TerminalBenchTask",
    "load_task_yaml",
    "load_tb_task",
    "parse_pytest_output",
]
