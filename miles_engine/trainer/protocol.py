"""The trainer backend interface (torch-free): what the driver calls, whatever runs behind it.

Implementations: :class:`~miles_engine.trainer.torch_trainer.TorchTrainer` (one process),
:class:`~miles_engine.trainer.distributed.FSDPTrainer` (N ranks behind one driver-side
proxy), :class:`~miles_engine.trainer.megatron.proxy.MegatronTrainerProxy` (megatron-core
TP / PP ranks); :func:`miles_engine.trainer.factory.create_trainer` picks one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from miles_engine.errors import MilesError

if TYPE_CHECKING:
    from miles_engine.rollout.types import Group


class TrainerError(MilesError):
    """The trainer cannot go on (a rank died, a step failed)."""


class BatchError(TrainerError, ValueError):
    """A batch the trainer refuses before touching the model (names the group / row and why)."""


@runtime_checkable
class TrainerBackend(Protocol):
    @property
    def weight_version(self) -> int:
        """Optimizer steps taken so far (SFT and RL); the version the next weight push carries."""

    def train_step(self, groups: Sequence[Group]) -> dict[str, float]:
        """One RL step on whole groups (``ppo_epochs x minibatches`` optimizer steps); metrics."""

    def sft_step(self, batch: Sequence[Any]) -> dict[str, float]:
        """One supervised step on ``(token_ids, loss_mask)`` rows (loss on mask-1 tokens only)."""

    def named_tensors(self, dtype: str | None = None) -> Iterator[tuple[str, Any]]:
        """Full (gathered) policy tensors under the Hugging Face state-dict names."""

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer(s), scheduler(s), step counters: everything to resume."""

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...
