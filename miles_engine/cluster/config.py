"""``placement.ray``: which cluster, and what each placed component asks of it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from miles_engine.components import Section


MAX_TEMP_DIR = 42
AUTO_FIT = ("Unset: 1 CPU, or, when the run's actors would need more CPUs than the cluster has, an equal share of what "
            "the set ones leave")


class RayOptions(Section):
    address: str | None = Field(
        None, description="a running cluster: 'auto' (the one `ray start --head` made on this machine) or the "
        "HOST:PORT of its head (GCS); unset: a private one-node cluster for this run, on 127.0.0.1 only, "
        "stopped at the end")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of the private cluster (default: this machine's)")
    num_gpus: int | None = Field(None, ge=0, description="GPUs of the private cluster (default: detected)")
    temp_dir: str | None = Field(None, description="the private cluster's session directory (default: a fresh "
                                 "/tmp/miles-ray-*; unix socket paths under it must stay short)")
    namespace: str = Field("miles", description="the Ray namespace of the run's actors")
    dashboard: bool = Field(False, description="start Ray's dashboard with the private cluster")
    engine_resources: dict[str, float] | None = Field(
        None, description="what one engine actor reserves (one placement-group bundle per engine); an engine group "
        "on a cuda device adds GPU: 1. " + AUTO_FIT)
    trainer_resources: dict[str, float] | None = Field(
        None, description="what one trainer rank actor reserves (one bundle per rank); trainer.parallel.device=cuda "
        "adds GPU: 1. " + AUTO_FIT)
    episode_runners: int = Field(
        2, ge=1, description="episode runner actors (each owns its sandbox backend and runs the task's agent); "
        "the scheduler hands each episode to the least busy one")
    runner_resources: dict[str, float] | None = Field(
        None, description="what one episode runner actor reserves (one bundle per runner, the bundles spread over "
        "nodes). " + AUTO_FIT)
    session_servers: int = Field(
        0, ge=0, description="TITO session servers as Ray actors (one bundle each, spread over nodes), each on its "
        "node's address with the driver's view of the engines; episodes use one on their runner's node. 0: the "
        "session server stays in the driver (enough on one node; set one per rollout node past that)")
    session_server_resources: dict[str, float] | None = Field(
        None, description="what one session-server actor reserves. " + AUTO_FIT)
    episode_retries: int = Field(
        1, ge=0, description="times an episode lost with a runner (or session server) that died is run again; "
        "past that it is a failed trajectory naming the runner")
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="how each placement group's bundles spread over nodes")
    connect_timeout_s: float = Field(60.0, gt=0, description="joining the cluster and reserving resources")

    @field_validator("temp_dir")
    @classmethod
    def _short_enough(cls, v: str | None) -> str | None:
        # Ray puts unix sockets at TEMP/session_<date>_<time>_<us>_<pid>/sockets/plasma_store (AF_UNIX: 107 bytes)
        if v is not None and len(v) > MAX_TEMP_DIR:
            raise ValueError(f"placement.ray.temp_dir is {len(v)} characters long ({v}); Ray's unix sockets live "
                             f"~64 characters below it and such paths are limited to 107 bytes: use a path of at "
                             f"most {MAX_TEMP_DIR} characters")
        return v

    @field_validator("engine_resources", "trainer_resources", "runner_resources", "session_server_resources")
    @classmethod
    def _non_negative(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        bad = {k: x for k, x in (v or {}).items() if x < 0}
        if bad:
            raise ValueError(f"resource amounts must be >= 0, got {bad}")
        return v


class PlacementConfig(Section):
    """Where the trainer runs relative to the engines (how many ranks: ``trainer.parallel.world_size``)."""

    trainer: Literal["in_process", "subprocess"] = Field(
        "subprocess", description="in_process: colocated with the engine (one process; only sync / one_step_off); "
        "subprocess: its own process(es) (trainer.parallel.world_size FSDP2 ranks), so generation and training "
        "overlap")
    backend: Literal["local", "ray"] = Field(
        "local", description="local: engines and trainer ranks as processes of this machine; ray: as Ray actors "
        "on the cluster placement.ray names (docs/ray.md)")
    ray: RayOptions = Field(default_factory=RayOptions)

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "trainer_ranks" in data:
            raise ValueError("placement.trainer_ranks was replaced by trainer.parallel.world_size (one key for the "
                             "number of trainer ranks)")
        return data

    @property
    def colocated(self) -> bool:
        return self.trainer == "in_process"
