"""Options of the ``nemo-gym`` environment."""

from __future__ import annotations

from pydantic import Field, model_validator

from miles_engine.components import Section


def _check_url(url: str, key: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"{key} must be an http:// or https:// URL, got {url!r}")
    return url.rstrip("/")


class ServerCommandOptions(Section):
    """Start a resources server as a subprocess (its own process group, killed on close)."""

    command: list[str] | str = Field(description="argv list, or a string run under 'sh -c'")
    url: str = Field(description="where the started server listens, e.g. http://127.0.0.1:8000")
    cwd: str | None = Field(None, description="working directory of the command")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables")
    startup_timeout_s: float = Field(60.0, gt=0, description="how long to wait for the server to answer")
    health_path: str | None = Field(
        None, description="path that must answer 2xx when ready; unset: any HTTP answer at the URL counts")

    @model_validator(mode="after")
    def _valid(self) -> ServerCommandOptions:
        self.url = _check_url(self.url, "server.url")
        if not self.command or (isinstance(self.command, str) and not self.command.strip()):
            raise ValueError("server.command must not be empty")
        if self.health_path is not None and not self.health_path.startswith("/"):
            raise ValueError(f"server.health_path must start with '/', got {self.health_path!r}")
        return self


class NemoGymOptions(Section):
    """A NeMo Gym resources server (``url`` or ``server``) and its dataset rows (``jsonl`` or ``hf_dataset``)."""

    name: str = Field("nemo-gym", description="environment name shown in listings and errors")
    url: str | None = Field(None, description="base URL of a running resources server")
    server: ServerCommandOptions | None = Field(None, description="start the resources server with this command")
    jsonl: str | None = Field(None, description="dataset rows: a NeMo Gym JSONL file")
    hf_dataset: str | None = Field(
        None, description="dataset rows: a Hugging Face dataset name (from the local cache) or save_to_disk dir")
    hf_config: str | None = None
    hf_split: str = "train"
    id_field: str | None = Field(None, description="row field holding the task id; unset: 'row-<index>'")
    limit: int | None = Field(None, ge=1, description="use only the first N rows")
    max_turns: int = Field(16, ge=1)
    agent_timeout_s: float = Field(600.0, gt=0)
    request_timeout_s: float = Field(60.0, gt=0, description="timeout of seed_session and tool calls")
    verify_timeout_s: float = Field(120.0, gt=0)
    model: str = Field("miles-policy", description="model name written into the Response sent to /verify")

    @model_validator(mode="after")
    def _one_of_each(self) -> NemoGymOptions:
        if (self.url is None) == (self.server is None):
            raise ValueError("set exactly one of 'url' (a running resources server) or 'server' (a command to start)")
        if (self.jsonl is None) == (self.hf_dataset is None):
            raise ValueError("set exactly one of 'jsonl' or 'hf_dataset' (the dataset rows)")
        if self.url is not None:
            self.url = _check_url(self.url, "url")
        return self

    @property
    def base_url(self) -> str:
        return self.url if self.url is not None else self.server.url  # type: ignore[union-attr]
