"""miles environment plugin for Harbor task directories (read at the file-format level)."""

from miles_env_harbor.config import TaskConfig, load_task_config, parse_task_config
from miles_env_harbor.rewards import parse_reward_json, parse_reward_txt, scalar_reward
from miles_env_harbor.source import HarborSource
from miles_env_harbor.task import HarborTask, load_harbor_task
from miles_env_harbor.verifier import SANDBOX_FACTORY_KEY

__all__ = [
    "SANDBOX_FACTORY_KEY",
    "HarborSource",
    "HarborTask",
    "TaskConfig",
    "load_harbor_task",
    "load_task_config",
    "parse_reward_json",
    "parse_reward_txt",
    "parse_task_config",
    "scalar_reward",
]
