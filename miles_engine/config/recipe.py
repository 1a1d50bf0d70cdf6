"""The recipe: typed sections, one model per component, validated when loaded."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field, ValidationError, model_serializer, model_validator

from miles_engine.cluster.config import PlacementConfig
from miles_engine.components import Section
from miles_engine.config.yaml_source import apply_overrides, load_yaml_file
from miles_engine.engines.fleet.build import (
    check_on_update,
    check_precision,
    check_transport,
    create_kinds,
    group_names,
)
from miles_engine.engines.fleet.config import EngineGroupConfig, FleetConfig
from miles_engine.errors import ConfigError, MilesError, format_validation_error
from miles_engine.evaluation.config import EvalConfig  # the `eval` section (miles eval, eval during training)
from miles_engine.metrics import MetricsConfig
from miles_engine.models.policy_tokenizer import TokenizerConfig
from miles_engine.models.tiny import TinyModelConfig
from miles_engine.precision.config import PrecisionConfig, stage_only_overrides
from miles_engine.rewards.config import RewardConfig
from miles_engine.rollout.buffer import BufferOptions
from miles_engine.rollout.config import RolloutConfig
from miles_engine.sft.config import SFTRunConfig
from miles_engine.teachers.config import OPDRunConfig
from miles_engine.tito.service import RunSessionServerConfig
from miles_engine.trainer.config import TrainerConfig
from miles_engine.weights.config import WeightsConfig

if TYPE_CHECKING:
    from miles_engine.hub import Hub


DERIVED_TRAINER_KEYS = ("weight_format", "weight_exceptions")  # from the precision section


class RunConfig(Section):
    steps: int = Field(100, ge=0, description="RL steps (0: an SFT-only run)")
    max_minutes: float | None = Field(None, gt=0, description="stop RL after this long (wall clock, whole run)")
    out_dir: str = "runs"
    name: str | None = Field(None, description="run directory name (default: recipe name + timestamp)")
    checkpoint_every: int = Field(0, ge=0, description="RL steps between checkpoints (0: only at the end)")
    checkpoint_keep: int = Field(2, ge=1, description="newest checkpoints kept on disk")


class ComponentRef(Section):
    """A component named by registered name or dotted import path, plus its options."""

    name: str
    options: dict[str, Any] = Field(default_factory=dict)


class SandboxRef(Section):
    backend: str = "local"
    options: dict[str, Any] = Field(default_factory=dict)


class RecipeConfig(Section):
    """The root of a recipe YAML. Evaluation uses the first sections; training all of them."""

    description: str = ""
    seed: int = 0
    environment: ComponentRef
    sandbox: SandboxRef = Field(default_factory=SandboxRef)
    agent: ComponentRef = Field(default_factory=lambda: ComponentRef(name="oracle"))
    eval: EvalConfig = Field(default_factory=EvalConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    chat_family: ComponentRef = Field(default_factory=lambda: ComponentRef(name="chatml"))
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    model: TinyModelConfig = Field(default_factory=TinyModelConfig)
    engines: list[EngineGroupConfig] = Field(
        default_factory=lambda: [EngineGroupConfig()], min_length=1,
        description="engine groups behind the router (default: one embedded engine in the driver process)")
    fleet: FleetConfig = Field(default_factory=FleetConfig)
    session_server: RunSessionServerConfig = Field(default_factory=RunSessionServerConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    sft: SFTRunConfig = Field(default_factory=SFTRunConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    buffer: BufferOptions = Field(default_factory=BufferOptions)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    opd: OPDRunConfig | None = Field(None, description="on-policy distillation teachers (with trainer.opd)")
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig, description="the low-precision contract "
                                       "every stage touching the weights obeys (miles_engine.precision)")

    @model_validator(mode="before")
    @classmethod
    def _moved_sections(cls, data: Any) -> Any:
        if isinstance(data, dict) and "engine" in data:
            raise ValueError("the engine section became engines, a list of engine groups: e.g. engines: [{kind: "
                             "embedded, options: {max_batch_size: 64, threads: 1}}] (kinds: embedded, server, "
                             "sglang, external)")
        return data

    @model_validator(mode="after")
    def _routing_replay_records_experts(self) -> RecipeConfig:
        # R3 replays the experts the engines chose for each sampled token: the session server must ask for them
        if self.trainer.algorithm.routing_replay and not self.session_server.record_routed_experts:
            if "record_routed_experts" in self.session_server.model_fields_set:
                raise ValueError("trainer.algorithm.routing_replay=true replays the MoE experts the engines routed "
                                 "each sampled token to, but session_server.record_routed_experts=false records none; "
                                 "drop that override (routing replay turns it on)")
            self.session_server.record_routed_experts = True
        return self

    @model_serializer(mode="wrap")
    def _without_derived_keys(self, handler: Any) -> Any:
        # keys the recipe derives from another section are not part of it: a run's config.yaml, loaded again
        # with a precision override, must not carry the old derived value as if a user had set it
        data = handler(self)
        if isinstance(data, dict) and isinstance(data.get("trainer"), dict):
            for key in DERIVED_TRAINER_KEYS:
                data["trainer"].pop(key, None)
        lora = data.get("trainer", {}).get("lora") if isinstance(data, dict) else None
        if isinstance(lora, dict):  # weights.lora says it
            lora.pop("push", None)
        disk_delta = data.get("weights", {}).get("disk_delta") if isinstance(data, dict) else None
        if isinstance(disk_delta, dict):  # rollout.on_update says it
            disk_delta.pop("pause_mode", None)
        return data

    @model_validator(mode="after")
    def _one_precision_contract(self) -> RecipeConfig:
        # the trainer's and the engines' formats come from precision alone: a stage set on its own breaks the contract
        p, t = self.precision, self.trainer
        derived = dict(zip(DERIVED_TRAINER_KEYS, (p.train, list(p.exceptions))))
        overrides = [f"trainer.{k}" for k, v in derived.items() if k in t.model_fields_set and getattr(t, k) != v]
        overrides += stage_only_overrides(self.engines)
        if overrides:
            raise ValueError(f"{', '.join(overrides)} would set one stage's precision alone; the precision section "
                             f"sets every stage at once (precision.train, precision.rollout, precision.kv_cache, "
                             f"precision.exceptions)")
        if p.max_logprob_gap is not None and t.algorithm.old_logprobs == "rollout":
            raise ValueError("precision.max_logprob_gap compares the trainer's log-probs with the engine's: it needs "
                             "trainer.algorithm.old_logprobs=recompute, not rollout")
        if t.true_on_policy and p.train != p.rollout:
            raise ValueError(f"trainer.true_on_policy=true needs the trainer and the engines to compute with the same "
                             f"weights: precision.train={p.train!r} differs from precision.rollout={p.rollout!r}")
        self.trainer = t.model_copy(update=derived)
        self.trainer._quantisation_aware()  # the trainer's own rules, on the derived format
        return self

    @model_validator(mode="after")
    def _lora_push(self) -> RecipeConfig:
        # trainer.lora.push is derived from weights.lora: adapters only where every engine can merge them itself
        t, w = self.trainer, self.weights
        if "push" in t.lora.model_fields_set and t.lora.push != "merged":
            raise ValueError("trainer.lora.push is derived from weights.lora; set weights.lora (auto, merged, adapters)")
        if not t.lora.enabled:
            if w.lora == "adapters":
                raise ValueError("weights.lora=adapters needs trainer.lora.enabled=true (there are no adapters to push)")
            return self
        why = self._no_adapter_pushes()
        if w.lora == "adapters" and why is not None:
            raise ValueError(f"weights.lora=adapters: {why}; use weights.lora=merged (or auto)")
        push = "adapters" if w.lora == "adapters" or (w.lora == "auto" and why is None and all(
            g.dtype == "float32" for g in self.engines)) else "merged"
        self.trainer = t.model_copy(update={"lora": t.lora.model_copy(update={"push": push})})
        return self

    def _no_adapter_pushes(self) -> str | None:
        """Why the engines cannot take adapter-only pushes (None: they can)."""
        for i, g in enumerate(self.engines):
            if g.kind not in ("embedded", "server"):
                return (f"engines.{i} is kind {g.kind!r}, which loads merged weights only; kinds that merge adapters "
                        f"themselves: embedded, server")
        if self.weights.transport not in ("colocated", "broadcast"):
            return (f"weights.transport={self.weights.transport!r} ships whole tensors; adapters travel by colocated "
                    f"or broadcast")
        if self.precision.quantised:
            return (f"precision.rollout={self.precision.rollout!r}: the engines hold quantised weights, and the "
                    f"trainer quantises the merged weight itself")
        return None

    @model_validator(mode="after")
    def _p2p_sources(self) -> RecipeConfig:
        # p2p's sources gather the torch trainer's HF-named tensors; quantised engines take their parts by broadcast
        # or disk_delta
        if self.weights.transport != "p2p":
            return self
        if self.trainer.backend != "torch":
            raise ValueError(f"weights.transport='p2p' needs trainer.backend='torch' (got {self.trainer.backend!r}): "
                             f"its sources are the torch trainer's ranks; use weights.transport=broadcast")
        if self.precision.quantised:
            raise ValueError(f"weights.transport='p2p' ships full-precision tensors; precision.rollout="
                             f"{self.precision.rollout!r} needs weights.transport=broadcast, disk_delta or colocated")
        return self

    @model_validator(mode="after")
    def _one_on_update(self) -> RecipeConfig:
        # what a push does to running requests is rollout.on_update (run/compose.py passes it to the
        # transport); weights.disk_delta.pause_mode, its older spelling, is honoured where it is not the default
        d, r = self.weights.disk_delta, self.rollout
        if d.pause_mode != "retract" and d.pause_mode != r.on_update:
            if "on_update" in r.model_fields_set:
                raise ValueError(f"weights.disk_delta.pause_mode={d.pause_mode!r} differs from rollout.on_update="
                                 f"{r.on_update!r}; what a push does to running requests is set once, by "
                                 f"rollout.on_update (drop weights.disk_delta.pause_mode)")
            self.rollout = r.model_copy(update={"on_update": d.pause_mode})
        return self

    @model_validator(mode="after")
    def _true_on_policy(self) -> RecipeConfig:
        # the engines' true_on_policy is derived from trainer.true_on_policy (run/compose.py): one key
        if self.trainer.true_on_policy:
            for i, g in enumerate(self.engines):
                if g.kind not in ("embedded", "server") or g.dtype != "float32":
                    raise ValueError(f"trainer.true_on_policy=true needs engines of our own kinds (embedded, server) "
                                     f"in float32; engines.{i} is kind {g.kind!r}, dtype {g.dtype!r}")
        return self


def resolve_recipe_path(ref: str | Path, hub: Hub) -> Path:
    """A path to a YAML file, or the name of a packaged recipe."""
    path = Path(ref)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ConfigError(f"recipe file '{path}' does not exist")
        return path
    registered = hub.get("recipe", str(ref))
    return registered.component.path  # type: ignore[union-attr]


def load_recipe(ref: str | Path, overrides: list[str] | None = None, *, hub: Hub) -> RecipeConfig:
    """Load, override and validate a recipe, including each component's own options (built by ``hub``)."""
    path = resolve_recipe_path(ref, hub)
    data, lines = load_yaml_file(path)
    apply_overrides(data, overrides or [])
    try:
        recipe = RecipeConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, model=RecipeConfig, file=str(path), lines=lines)) from exc
    refs = {
        "environment": ("environment", recipe.environment.name, recipe.environment.options),
        "sandbox": ("sandbox", recipe.sandbox.backend, recipe.sandbox.options),
        "agent": ("agent", recipe.agent.name, recipe.agent.options),
        "chat_family": ("chat_family", recipe.chat_family.name, recipe.chat_family.options),
    }
    if recipe.eval.environment is not None:
        refs["eval.environment"] = ("environment", recipe.eval.environment.name, recipe.eval.environment.options)
    for i, ref in enumerate(recipe.reward.components or []):
        refs[f"reward.components.{i}"] = ("reward", ref.name, ref.options)
    for i, group in enumerate(recipe.engines):
        refs[f"engines.{i}"] = ("engine", group.kind, group.options)
    for section, (kind, name, options) in refs.items():
        try:
            comp = hub.component(kind, name)  # type: ignore[arg-type]
        except MilesError as exc:
            line = (lines.get(f"{section}.name") or lines.get(f"{section}.backend") or lines.get(f"{section}.kind")
                    or lines.get(section))
            raise ConfigError(f"{path}:{line or '?'}: {section}: {exc}") from exc
        try:
            comp.options.model_validate(options)
        except ValidationError as exc:
            raise ConfigError(
                format_validation_error(
                    exc, prefix=f"{section}.options", model=comp.options, file=str(path), lines=lines
                )
            ) from exc
    _check_engines(recipe, hub, str(path), lines)
    return recipe


def _check_engines(recipe: RecipeConfig, hub: Hub, path: str, lines: dict[str, int]) -> None:
    """The weight transport must reach every engine group (one line naming both keys)."""
    kinds = create_kinds(hub, recipe.engines)  # cheap: a kind's factory only keeps its options
    try:
        group_names(recipe.engines)
        check_transport(recipe.weights.transport, recipe.engines, kinds)
    except ConfigError as exc:
        line = lines.get("weights.transport") or lines.get("engines") or "?"
        raise ConfigError(f"{path}:{line}: {exc}") from exc
    try:
        check_on_update(recipe.rollout.on_update, recipe.engines, kinds)
    except ConfigError as exc:
        line = lines.get("rollout.on_update") or lines.get("engines") or "?"
        raise ConfigError(f"{path}:{line}: {exc}") from exc
    try:
        check_precision(recipe.precision.rollout, recipe.precision.kv_cache, recipe.engines, kinds)
    except ConfigError as exc:
        line = lines.get("precision.rollout") or lines.get("precision") or lines.get("engines") or "?"
        raise ConfigError(f"{path}:{line}: {exc}") from exc
    if recipe.eval.engine is not None:  # the dedicated eval engines: their options and how snapshots reach them
        from miles_engine.engines.fleet.build import eval_transport

        group = recipe.eval.engine
        try:
            eval_transport(group, hub.create("engine", group.kind, group.options, where="eval.engine.options"))
        except ConfigError as exc:
            line = lines.get("eval.engine.options") or lines.get("eval.engine") or lines.get("eval") or "?"
            raise ConfigError(f"{path}:{line}: {exc}") from exc
