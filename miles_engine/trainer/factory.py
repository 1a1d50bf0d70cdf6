"""The one place a trainer backend is chosen (the composition root calls this).

    trainer = create_trainer(model, cfg.trainer, subprocess=cfg.placement.trainer == "subprocess")

- ``trainer.backend=torch``: ``world_size`` 1 (or None with ``parallel.world_size`` 1) -> a
  :class:`TorchTrainer` in this process; N -> an :class:`FSDPTrainer` with N ranks.
- ``trainer.backend=megatron``: a :class:`MegatronTrainerProxy` with ``world_size`` ranks (1 is
  fine: one subprocess), sizes from ``trainer.megatron``; needs the ``megatron`` extra.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from miles_engine.errors import ConfigError
from miles_engine.trainer.config import TrainerConfig
from miles_engine.trainer.protocol import TrainerBackend


def create_trainer(model: Any, config: TrainerConfig | dict[str, Any] | None = None, *,
                   world_size: int | None = None, subprocess: bool | None = None,
                   ranks: Any = None) -> TrainerBackend:
    """``subprocess`` (torch backend): force rank processes even for one rank (default: only for
    more than one). ``ranks``: where rank processes run (see :class:`FSDPTrainer`; Ray actors
    under ``placement.backend=ray``); implies rank processes."""
    cfg = TrainerConfig.load(config)
    world = world_size or cfg.parallel.world_size
    if cfg.backend == "megatron":
        if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
            raise ConfigError("trainer.backend=megatron needs megatron-core: pip install 'miles-engine[megatron]'")
        from miles_engine.trainer.megatron.proxy import MegatronTrainerProxy

        return MegatronTrainerProxy(model, cfg, world_size=world, ranks=ranks)
    if world > 1 or subprocess or ranks is not None:
        from miles_engine.trainer.distributed import FSDPTrainer

        return FSDPTrainer(model, cfg, world_size=world, ranks=ranks)
    from miles_engine.trainer.torch_trainer import TorchTrainer

    return TorchTrainer(model, cfg)
