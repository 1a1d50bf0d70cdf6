"""Shell drills: procedurally generated small terminal tasks with noisy demonstrations."""

from miles_env_terminal_tasks.drills.demos import Attempt
from miles_env_terminal_tasks.drills.options import ALL_KINDS, DrillOptions
from miles_env_terminal_tasks.drills.source import Demonstration, ShellDrillsSource
from miles_env_terminal_tasks.drills.task import DrillTask

__all__ = ["ALL_KINDS", "Attempt", "Demonstration", "DrillOptions", "DrillTask", "ShellDrillsSource"]
