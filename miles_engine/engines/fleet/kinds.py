"""What an engine kind is: a factory (registered through ``miles_register_engines``) whose
object starts one group's engines and says which weight transports can reach them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from miles_engine.engines.fleet.config import EngineGroupConfig
    from miles_engine.engines.protocol import RolloutEngine

Restore = Callable[[], Awaitable[tuple[Mapping[str, Any], int]]]


@dataclass
class FleetContext:
    """What every kind may need to start its engines.

    :param model: the policy's source: a model instance (random init or loaded) or a path/spec.
    :param state_dir: a directory the run owns (RUN_DIR/engines): logs, ports, saved models.
    :param restore: the trainer's current weights and version, for an engine (re)started mid-run.
    """

    model: Any
    state_dir: Path
    seed: int = 0
    restore: Restore | None = None
    env: Mapping[str, str] | None = None
    true_on_policy: bool = False  # batch-invariant arithmetic, identical to the trainer's (trainer.true_on_policy)
    # the rollout stage of the precision contract: the format the engines hold and its exceptions
    weight_format: str = "full"
    weight_exceptions: tuple[str, ...] = ()
    kv_cache: str = "full"  # precision.kv_cache
    # where a placeable kind's engine processes run (None: subprocesses of the driver; see EngineLauncher)
    launcher: EngineLauncher | None = None
    _model_dir: Path | None = field(default=None, repr=False)

    def model_config(self) -> dict[str, Any] | None:
        """The policy's Hugging Face config as a dict (an instance's, or a directory's config.json)."""
        config = getattr(self.model, "config", None)
        if config is not None and hasattr(config, "to_dict"):
            return config.to_dict()
        if isinstance(self.model, (str, Path)) and (Path(self.model) / "config.json").is_file():
            import json

            return json.loads((Path(self.model) / "config.json").read_text())
        return None

    def routed_experts_shape(self) -> tuple[int, int] | None:
        """``(layers, top_k)`` for decoding the routed experts an SGLang-compatible server returns."""
        from miles_engine.engines.http.wire import routed_experts_shape

        return routed_experts_shape(self.model_config())

    def model_path(self) -> str:
        """A path another process can load the policy from (an instance is saved once)."""
        if isinstance(self.model, (str, Path)):
            return str(self.model)
        if self._model_dir is None:
            out = self.state_dir / "model"
            tmp = self.state_dir / "model.tmp"
            if not (out / "config.json").is_file():
                import shutil

                shutil.rmtree(tmp, ignore_errors=True)
                self.model.save_pretrained(str(tmp), safe_serialization=True)
                shutil.rmtree(out, ignore_errors=True)
                tmp.rename(out)
            self._model_dir = out
        return str(self._model_dir)


class EngineLauncher(Protocol):
    """Places engine server processes elsewhere (``placement.backend=ray``: one Ray actor each)."""

    def device(self, group: EngineGroupConfig, index: int) -> str:
        """The device replica ``index`` of ``group`` uses where it is placed."""
        ...

    def process_factory(self, group_name: str, replica: int) -> Callable[..., Any]:
        """A factory with :class:`~miles_engine.engines.launch.ServerProcess`'s signature."""
        ...


@runtime_checkable
class EngineKind(Protocol):
    """``placeable`` (optional, default False): its engines are server processes a launcher may place."""

    in_process: bool  # its engines live in the driver process (they can share tensors: colocated)
    transports: tuple[str, ...]  # the weight transports that can reach its engines
    # optional: pause modes (rollout.on_update) its engines cannot honour -> why (see SGLANG_PAUSE_REFUSED)
    # pause_modes_refused: Mapping[str, str]
    # optional: precision_refusal(weight_format, kv_cache, group) -> why its engines cannot hold that
    # precision contract, None when they can; a kind without it receives full precision only

    async def start(self, group: EngineGroupConfig, name: str, ctx: FleetContext,
                    stack: AsyncExitStack) -> list[RolloutEngine]:
        """Start the group's ``group.replicas`` engines; register their teardown on ``stack``."""
        ...


# what a push may do to running requests where the engine is not ours (rollout.on_update)
SGLANG_PAUSE_REFUSED = {
    "wait": "SGLang's /pause_generation ends or keeps running requests (abort, retract, in_place) but has no mode "
            "that lets them finish first; use retract or in_place"}
VLLM_PAUSE_REFUSED = {
    "in_place": "vLLM's keep mode continues frozen requests on the new weights without saying at which token the "
                "weights changed, so their tokens' versions would be guessed; use retract (each is sent again "
                "with its tokens so far: the same tokens, the KV recomputed) or wait"}
