"""Test-only crash points: ``MILES_TEST_CRASH_AT=<point>@<step>[+<delay_s>]`` SIGKILLs this
process when the run reaches ``<point>`` of RL step ``<step>`` (after ``<delay_s>`` seconds, on a
timer, so the kill lands *inside* the work that follows). Unset, every call is a no-op.

Points: ``generation`` (waiting for the step's groups), ``train_step`` (the trainer is
stepping), ``checkpoint_write`` (the checkpoint's files are written, not yet renamed into
place; with the ranks' shards of ``checkpoint_format: dist``, once those are written), ``weight_publish`` (the trainer's weights are being pushed to the engines), ``trainer_offloaded`` (after the push, the trainer's
state is offloaded: ``trainer.offload``).
"""

from __future__ import annotations

import os
import signal
import threading

from miles_engine.errors import ConfigError

ENV = "MILES_TEST_CRASH_AT"
POINTS = ("generation", "train_step", "checkpoint_write", "weight_publish", "trainer_offloaded")


def parse(spec: str) -> tuple[str, int, float]:
    """``"train_step@3+0.2"`` -> ``("train_step", 3, 0.2)``; one clear error otherwise."""
    point, _, rest = spec.partition("@")
    step_text, _, delay_text = rest.partition("+")
    try:
        step, delay = int(step_text), float(delay_text or 0)
    except ValueError:
        step, delay = -1, -1.0
    if point not in POINTS or step < 0 or delay < 0:
        raise ConfigError(f"{ENV}={spec!r}: expected <point>@<step>[+<delay_s>] with point one of "
                          f"{', '.join(POINTS)} (e.g. checkpoint_write@2 or train_step@3+0.1)")
    return point, step, delay


def check_env() -> None:
    """Validate the variable at start-up, so a typo fails the run before anything trains."""
    spec = os.environ.get(ENV)
    if spec:
        parse(spec)


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def crash_point(point: str, step: int) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    name, at_step, delay = parse(spec)
    if name != point or at_step != step:
        return
    if delay == 0:
        _kill()
    timer = threading.Timer(delay, _kill)
    timer.daemon = True
    timer.start()
