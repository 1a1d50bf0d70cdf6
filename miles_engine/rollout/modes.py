"""Rollout modes: how generation overlaps training. Components, not branches in the driver.

The driver calls the same hooks whatever the mode::

    validate_mode(name, colocated=..., groups_per_step=..., buffer=...)   # at start-up
    mode = create_mode(name, scheduler, groups_per_step=n)
    await push_weights(...)                      # initial push: engines start from the trainer's weights
    await mode.start()
    for step in ...:
        groups = await buffer.get(n, current_version)
        await mode.before_train(step)
        ... train, push weights (version += 1) ...
        await mode.after_push(version)
    await mode.stop()

- ``sync``: each step's batch is generated entirely with the current weights; nothing is
  generated while training or pushing (staleness 0).
- ``one_step_off``: the batch of step k+1 is generated while step k trains; a push may land in
  the middle of it, so staleness is at most 1.
- ``fully_async``: generation never stops; staleness is bounded by admission control (when
  ``max_staleness`` is set) plus the buffer's get-time bound, and by the buffer's capacity.

The phase quota of ``sync`` / ``one_step_off`` is ``groups_per_step`` groups that reach the
buffer: a group dropped by a filter is replaced by one more submission.
"""

from __future__ import annotations

import logging
from typing import Any

from miles_engine.errors import ConfigError, unknown_name
from miles_engine.rollout.buffer import AsyncBuffer
from miles_engine.rollout.scheduler import Scheduler
from miles_engine.rollout.staleness import AdmissionControl

log = logging.getLogger(__name__)


class RolloutMode:
    name = "base"
    max_staleness: int | None = None  # the bound the mode guarantees by construction

    def __init__(self, scheduler: Scheduler, *, groups_per_step: int) -> None:
        if groups_per_step < 1:
            raise ConfigError(f"rollout.groups_per_step must be >= 1, got {groups_per_step}")
        self.scheduler = scheduler
        self.buffer: AsyncBuffer = scheduler.buffer
        self.groups_per_step = groups_per_step

    async def start(self) -> None:
        await self.scheduler.start()

    async def before_train(self, step: int) -> None:
        """Called after the step's groups were taken from the buffer, before training."""

    async def after_push(self, version: int) -> None:
        """Called once the engines serve ``version``."""
        self.scheduler.notify()

    async def stop(self) -> None:
        await self.scheduler.stop()

    def metrics(self) -> dict[str, float]:
        return {}


class _PhasedMode(RolloutMode):
    """Submits exactly one step's worth of groups per phase (plus replacements for drops)."""

    def __init__(self, scheduler: Scheduler, *, groups_per_step: int) -> None:
        super().__init__(scheduler, groups_per_step=groups_per_step)
        self._open = False
        self._base_submitted = 0
        self._base_dropped = 0
        scheduler.gate = self._gate

    def _gate(self) -> bool:
        if not self._open:
            return False
        accepted_or_pending = (self.scheduler.submitted_groups - self._base_submitted
                               - (self.buffer.dropped_groups - self._base_dropped))
        return accepted_or_pending < self.groups_per_step

    def open_phase(self) -> None:
        self._base_submitted = self.scheduler.submitted_groups
        self._base_dropped = self.buffer.dropped_groups
        self._open = True
        self.scheduler.notify()

    async def start(self) -> None:
        self.open_phase()
        await super().start()


class SyncMode(_PhasedMode):
    name = "sync"
    max_staleness = 0

    async def before_train(self, step: int) -> None:
        self._open = False
        await self.scheduler.wait_idle()  # nothing is generated while training / pushing

    async def after_push(self, version: int) -> None:
        self.open_phase()


class OneStepOffMode(_PhasedMode):
    name = "one_step_off"
    max_staleness = 1

    async def before_train(self, step: int) -> None:
        self.open_phase()  # the next batch generates while this step trains


class FullyAsyncMode(RolloutMode):
    name = "fully_async"

    def __init__(self, scheduler: Scheduler, *, groups_per_step: int, admission: bool = True) -> None:
        """The bound is the buffer's ``max_staleness`` (one source of truth: the buffer enforces it
        at get time and waits for stragglers; admission control keeps it from having to drop)."""
        super().__init__(scheduler, groups_per_step=groups_per_step)
        bound = self.buffer.options.max_staleness
        self.max_staleness = bound
        self.admission: AdmissionControl | None = None
        if bound is not None and admission:
            self.admission = AdmissionControl(bound, groups_per_step)
            scheduler.gate = self._gate
        self._base_submitted = 0
        self._base_dropped = 0

    async def start(self) -> None:
        if self.admission is not None:
            self.admission.base_version = self.scheduler.version_fn()
            self._base_submitted = self.scheduler.submitted_groups
            self._base_dropped = self.buffer.dropped_groups
        await super().start()

    def _gate(self) -> bool:
        assert self.admission is not None
        consumable = (self.scheduler.submitted_groups - self._base_submitted
                      - (self.buffer.dropped_groups - self._base_dropped))
        return self.admission.allows(consumable, self.scheduler.version_fn())

    def metrics(self) -> dict[str, float]:
        return {} if self.admission is None else {"scheduler/admission_holds": float(self.admission.holds)}


MODES: dict[str, type[RolloutMode]] = {"sync": SyncMode, "one_step_off": OneStepOffMode,
                                       "fully_async": FullyAsyncMode}


def validate_mode(name: str, *, colocated: bool, groups_per_step: int, buffer: AsyncBuffer | None = None,
                  max_staleness: int | None = None) -> None:
    """Refuse incompatible settings at start-up, each with the reason and the fix."""
    if name not in MODES:
        raise unknown_name("rollout mode", name, MODES)
    if name == "fully_async" and colocated:
        raise ConfigError("rollout mode 'fully_async' needs the engines apart from the trainer: colocated, "
                          "they share one device and one process, so generation cannot run while the trainer "
                          "trains (and weights are swapped in place). Use mode 'sync' (or 'one_step_off' with "
                          "an embedded CPU engine), or run the engines as separate processes (broadcast weights)")
    bound = max_staleness
    if bound is None and buffer is not None:
        bound = buffer.options.max_staleness
    if name == "one_step_off" and bound == 0:
        raise ConfigError("rollout.mode 'one_step_off' has staleness 1 by construction but buffer.max_staleness is 0; "
                          "use rollout.mode 'sync' or buffer.max_staleness >= 1")
    if buffer is not None and buffer.capacity < groups_per_step:
        raise ConfigError(f"buffer.capacity_groups ({buffer.capacity}) is smaller than the groups trained per "
                          f"step (rollout.groups_per_step: {groups_per_step}): a step could never be filled")
    if name == "fully_async" and bound is None:
        log.warning("rollout mode 'fully_async' without max_staleness: staleness is bounded only by the buffer "
                    "capacity and the in-flight budget (set buffer.max_staleness to bound it)")


def create_mode(name: str, scheduler: Scheduler, *, groups_per_step: int, **options: Any) -> RolloutMode:
    if name not in MODES:
        raise unknown_name("rollout mode", name, MODES)
    return MODES[name](scheduler, groups_per_step=groups_per_step, **options)
