"""The trainer as the run's components see it: one call at a time, off the event loop.

The driver trains and pushes in turn, but an engine restarted mid-step asks for the current
weights at any moment; a trainer whose ranks sit behind pipes (FSDP2) must not see two calls
interleaved, so every call holds one lock and runs in a worker thread.

Under ``placement.backend=ray`` with the broadcast transport, trainer rank 0 broadcasts its own
export (:meth:`use_rank0_sender`): :meth:`export_for_push` then hands out rank 0's
:class:`~miles_engine.cluster.weight_sender.Rank0Export` (specs only) and the last pushed
weights stay on rank 0 until a restarted engine asks for them.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from miles_engine.cluster.weight_sender import Rank0Export, Rank0Sender
from miles_engine.config.recipe import RecipeConfig
from miles_engine.trainer.factory import create_trainer
from miles_engine.trainer.step_rows import ROWS_KEY


class TrainerAccess:
    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._lock = threading.Lock()
        self._pushed: tuple[dict[str, Any], int] | None = None
        self._rank0: Any = None  # Rank0Sender when trainer rank 0 broadcasts the weights itself
        self._p2p: Any = None  # TrainerSources when the trainer ranks write to the engines (weights.transport=p2p)
        self._pushed_on_rank0: Any = None  # its Rank0Export last pushed
        self.step_rows: dict[tuple[str, int], dict[str, Any]] = {}  # the last train_step's, see train_step
        self.offload_dir: Path | None = None  # trainer.offload=disk: where the ranks' offload files go
        self.optimizer_state_dir: Path | None = None  # trainer.optimizer_state=disk: the ranks' state files

    @classmethod
    def create(cls, policy: Any, cfg: RecipeConfig, ranks: Any = None, run_dir: Path | None = None) -> TrainerAccess:
        """``trainer.backend`` picks the backend, ``placement.trainer`` where it runs (the megatron
        backend always runs in rank processes), ``trainer.parallel.world_size`` how many ranks;
        ``ranks``: rank processes placed elsewhere (Ray actors). ``trainer.offload=disk`` writes
        into ``RUN_DIR/offload`` unless ``trainer.offload_dir`` says where, ``trainer.optimizer_state=disk``
        into ``RUN_DIR/optimizer_state``."""
        trainer_cfg = cfg.trainer
        if trainer_cfg.offload == "disk" and trainer_cfg.offload_dir is None and run_dir is not None:
            trainer_cfg = trainer_cfg.model_copy(update={"offload_dir": str(run_dir / "offload")})
        if trainer_cfg.optimizer_state == "disk" and trainer_cfg.optimizer_state_dir is None and run_dir is not None:
            trainer_cfg = trainer_cfg.model_copy(update={"optimizer_state_dir": str(run_dir / "optimizer_state")})
        access = cls(create_trainer(policy, trainer_cfg, subprocess=cfg.placement.trainer == "subprocess", ranks=ranks))
        access.offload_dir = Path(trainer_cfg.offload_dir) if trainer_cfg.offload == "disk" else None
        if trainer_cfg.optimizer_state == "disk" and trainer_cfg.optimizer_state_dir is not None:
            access.optimizer_state_dir = Path(trainer_cfg.optimizer_state_dir)
        return access

    def _locked(self, fn: Any, *args: Any) -> Any:
        with self._lock:
            return fn(*args)

    async def _call(self, fn: Any, *args: Any) -> Any:
        return await asyncio.to_thread(self._locked, fn, *args)

    @property
    def weight_version(self) -> int:
        return int(self.backend.weight_version)

    async def train_step(self, groups: Sequence[Any], record: Collection[tuple[str, int]] | None = None
                         ) -> dict[str, float]:
        """One RL step. ``record``: the (group_id, index) whose trainer log-probs the run records; a
        backend that reports per-trajectory rows leaves them in :attr:`step_rows` (else it is empty)."""
        if record is None or not getattr(self.backend, "records_rows", False):
            self.step_rows = {}
            return await self._call(self.backend.train_step, groups)
        metrics = await self._call(self.backend.train_step, groups, record)
        self.step_rows = metrics.pop(ROWS_KEY, None) or {}
        return metrics

    async def sft_step(self, batch: Sequence[Any]) -> dict[str, float]:
        return await self._call(self.backend.sft_step, batch)

    async def precision_gaps(self, groups: Sequence[Any], fmt: str, exceptions: Sequence[str]) -> dict[str, float] | None:
        """Per tensor class, the log-prob gap quantising it alone makes (None: a backend without the
        diagnosis, one whose policy lives in rank processes)."""
        diagnose = getattr(self.backend, "precision_gaps", None)
        return None if diagnose is None else await self._call(diagnose, groups, fmt, exceptions)

    async def named_tensors(self) -> list[tuple[str, Any]]:
        # an adapter export is a list already: it keeps the bases a check merges with
        return await self._call(lambda: _pairs(self.backend.named_tensors()))

    def use_rank0_sender(self, control_timeout_s: float = 120.0) -> Any:
        """Trainer rank 0 as the broadcast group's rank 0 (a Rank0Sender for the transport), when
        its ranks are Ray actors; None otherwise (the driver stays rank 0)."""
        weight_ranks = getattr(self.backend, "weight_ranks", None)
        ranks = weight_ranks() if weight_ranks is not None else None
        if ranks is None:
            return None
        self._rank0 = Rank0Sender(ranks, control_timeout_s=control_timeout_s)
        return self._rank0

    def p2p_sources(self) -> Any:
        """The trainer's ranks as the p2p transport's sources; from now on a push's export stays on them."""
        from miles_engine.weights.p2p import TrainerSources

        self._p2p = TrainerSources(self.backend, lock=self._lock)
        return self._p2p

    async def export_for_push(self) -> Any:
        """What a push sends: the trainer's tensors here, or (rank-0 sender, p2p sources) an export
        the trainer ranks keep."""
        if self._p2p is not None:
            from miles_engine.weights.p2p import P2PExport

            return await P2PExport.stage(self._p2p, self.weight_version)
        if self._rank0 is None:
            return await self.named_tensors()
        version = self.weight_version
        keep = self._pushed_on_rank0.version if self._pushed_on_rank0 is not None else None
        specs = await self._call(self.backend.stage_export, version, keep)
        return Rank0Export(version, specs, self._rank0)

    def record_push(self, tensors: Any, version: int) -> None:
        """The weights every engine now serves (kept until the next push: the export already made them)."""
        if hasattr(tensors, "fetch"):  # rank 0's export: it stays there
            self._pushed, self._pushed_on_rank0 = None, tensors
            return
        self._pushed = (dict(tensors), int(version))

    async def offload(self) -> dict[str, float]:
        """The trainer waits for its next step: its state leaves memory (``trainer.offload``); the
        next call brings it back. Returns the bytes moved per kind and the seconds."""
        offload = getattr(self.backend, "offload", None)
        return {} if offload is None else await self._call(offload)

    async def last_pushed(self) -> tuple[dict[str, Any], int]:
        """The weights and version an engine restarted now must serve: the last pushed ones (the
        trainer may be a step ahead; a delta transport applies its next version on top of these)."""
        if self._pushed is not None:
            reload = getattr(self.backend, "reload", None)  # one process: they are views of the trainer's state
            if reload is not None:
                await self._call(reload)
            return self._pushed
        if self._pushed_on_rank0 is not None:  # the only time they cross to the driver
            return await self._pushed_on_rank0.fetch(), self._pushed_on_rank0.version
        return await self._call(lambda: (dict(self.backend.named_tensors()), int(self.backend.weight_version)))

    async def state_dict(self) -> dict[str, Any]:
        return await self._call(self.backend.state_dict)

    @property
    def checkpoint_shards(self) -> str | None:
        """Set when the backend's ranks write their own checkpoint shards (see ``save_shards``)."""
        return getattr(self.backend, "checkpoint_shards", None)

    async def save_shards(self, directory: Any) -> dict[str, Any]:
        return await self._call(self.backend.save_shards, directory)

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        await self._call(self.backend.load_state_dict, state)

    def close(self) -> None:
        self._locked(self.backend.close)
        from miles_engine.trainer.offload import remove_stale

        if self.offload_dir is not None:  # a rank killed before it closed leaves its offload file
            remove_stale(self.offload_dir)
        if self.optimizer_state_dir is not None:  # and its optimizer state file
            remove_stale(self.optimizer_state_dir, ".optstate")


def _pairs(exported: Any) -> list[tuple[str, Any]]:
    return exported if isinstance(exported, list) else list(exported)
