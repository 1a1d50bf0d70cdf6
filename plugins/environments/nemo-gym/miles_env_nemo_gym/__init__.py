"""miles environment plugin: NeMo Gym resources servers over their HTTP wire format."""

from miles_env_nemo_gym.options import NemoGymOptions, ServerCommandOptions
from miles_env_nemo_gym.responses import output_items, parse_verify_reply, response_object
from miles_env_nemo_gym.rows import Row, load_rows
from miles_env_nemo_gym.server import ResourcesServerError, ServerProcess
from miles_env_nemo_gym.source import NemoGymSource
from miles_env_nemo_gym.task import NemoGymTask, ResourcesServerCallError

__all__ = [
    "NemoGymOptions",
    "NemoGymSource",
    "NemoGymTask",
    "ResourcesServerCallError",
    "ResourcesServerError",
    "Row",
    "ServerCommandOptions",
    "ServerProcess",
    "load_rows",
    "output_items",
    "parse_verify_reply",
    "response_object",
]
