"""The driver side of the Megatron backend: :class:`MegatronTrainerProxy` spawns the ranks
(subprocesses over gloo on CPU, NCCL on GPU, exactly like :class:`FSDPTrainer`) and implements
:class:`~miles_engine.trainer.protocol.TrainerBackend`.

Differences from the FSDP proxy: the parallel sizes are checked against the world size and the
model's shape before any process starts; a step's groups are split over the *data-parallel*
ranks, and the TP / PP peers of a data-parallel rank receive the same share (Megatron's rank
order ``tp-cp-ep-dp-pp``: rank = tp_rank + tp * (dp_rank + dp * pp_rank)); a checkpoint goes
to every rank, which loads its own shards.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from miles_engine.errors import ConfigError
from miles_engine.rollout.types import Group, without_transcripts
from miles_engine.trainer.config import TrainerConfig
from miles_engine.trainer.distributed import FSDPTrainer, _dumps
from miles_engine.trainer.megatron.dist_checkpoint import SUBDIR
from miles_engine.trainer.rows import as_sft_rows, balance, split_groups, validate_groups


def make_rank(model: Any, cfg: TrainerConfig, device: Any) -> Any:
    """Rank side (after ``init_process_group``): parallel state, then the rank trainer."""
    from miles_engine.trainer.megatron.trainer import MegatronTrainer, init_parallel

    init_parallel(cfg)
    return MegatronTrainer(model, cfg, device=device)


def model_shape(model: Any) -> Any | None:
    """The model's :class:`~.gpt.ModelShape` from its source without building it (None when the
    source is not readable here; the ranks check again)."""
    from miles_engine.trainer.megatron.gpt import shape_of

    config: Any = getattr(model, "config", None)
    try:
        if config is None and isinstance(model, str) and model.startswith("tiny:"):
            from miles_engine.models.loading import config_from, parse_tiny_spec

            config = config_from(parse_tiny_spec(model))
        elif config is None and isinstance(model, dict):
            from miles_engine.models.loading import config_from

            config = config_from(model)
        elif config is None and isinstance(model, (str, Path)):
            path = Path(model).expanduser()
            path = path / "config.json" if path.is_dir() else path
            if path.suffix == ".json" and path.exists():
                from miles_engine.models.loading import config_from

                config = config_from(json.loads(path.read_text()))
        elif config is None and hasattr(model, "model_type"):
            config = model
    except ImportError:
        return None
    return shape_of(config) if config is not None else None


class MegatronTrainerProxy(FSDPTrainer):
    """``world_size`` Megatron ranks behind the trainer interface (``trainer.megatron`` sizes)."""

    rank_factory = staticmethod(make_rank)

    def __init__(self, model: Any, config: TrainerConfig | dict[str, Any] | None = None, *,
                 world_size: int | None = None, ranks: Any = None) -> None:
        cfg = TrainerConfig.load(config)
        if cfg.backend != "megatron":
            raise ConfigError("MegatronTrainerProxy needs trainer.backend=megatron")
        world = world_size or cfg.parallel.world_size
        m = cfg.megatron
        self.dp = m.check(world, model_shape(model))
        from miles_engine.trainer.megatron.trainer import check_supported

        check_supported(cfg)
        self.tp, self.pp = m.tensor_parallel, m.pipeline_parallel
        super().__init__(model, cfg, world_size=world, ranks=ranks)

    def _dp_rank(self, rank: int) -> int:
        return (rank // self.tp) % self.dp

    records_rows = False  # its ranks' trainer reports no per-trajectory rows: the driver computes advantages

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        cfg = self.config
        validate_groups(groups, vocab_size=self.vocab_size, need_teacher=cfg.opd.enabled,
                        std_normalization=cfg.uses_std_normalization, routing=self.routing,
                        need_candidates=cfg.opd.uses_candidates)
        minibatches = split_groups(without_transcripts(groups), min(cfg.minibatches, len(groups)))
        shares = [split_groups(mb, self.dp) for mb in minibatches]
        per_rank = [[share[self._dp_rank(r)] for share in shares] for r in range(self.world_size)]
        metrics = self._send("train", per_rank, "train_step")
        self._version = int(metrics["weight_version"])
        return metrics

    def sft_step(self, batch: list[Any]) -> dict[str, float]:
        rows = as_sft_rows(batch, self.vocab_size)
        bins = balance([len(r.token_ids) for r in rows], self.dp)
        shares = [[rows[i] for i in b] for b in bins]
        metrics = self._send("sft", [shares[self._dp_rank(r)] for r in range(self.world_size)], "sft_step")
        self._version = int(metrics["weight_version"])
        return metrics

    def load_state_dict(self, state: dict[str, Any]) -> None:
        data = _dumps(state)
        self._send("load_state_dict", [data] * self.world_size)
        self._version = int(state["weight_version"])

    @property
    def checkpoint_shards(self) -> str | None:
        """The checkpoint subdirectory the ranks write their shards into
        (``trainer.megatron.checkpoint_format=dist``); None: :meth:`state_dict` holds everything."""
        return SUBDIR if self.config.megatron.checkpoint_format == "dist" else None

    def save_shards(self, directory: str | Path) -> dict[str, Any]:
        """Every rank writes its shards into ``directory`` in parallel (Megatron's distributed
        format); rank 0's small rest of the state (for ``trainer.pt``)."""
        return self.call(_save_shards, str(directory))


def _save_shards(trainer: Any, directory: str) -> dict[str, Any]:
    return trainer.save_shards(directory)
