"""``mode: external``: run a command on a checkpoint directory and read its JSON result back.

The command (argv, no shell) gets ``{checkpoint}``, ``{step}``, ``{run_dir}``, ``{output}`` and
``{tasks}`` (a JSON file with the held-out task ids) replaced, and the same values as
``MILES_EVAL_*`` environment variables. It writes its JSON to ``{output}`` or prints it as its
last stdout line. It runs in its own process group, killed whole on timeout or cancellation:
nothing is left running.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
from pathlib import Path
from typing import Any

from miles_engine.evaluation.runner import AttemptRecord

TAIL = 2000


class ExternalEvalError(RuntimeError):
    """The command failed, timed out, or its result is not the JSON expected."""


def link_copy(src: Path, dst: Path) -> Path:
    """A copy of a checkpoint directory made of hard links (a copy where links are refused), so
    the checkpoint rotation cannot delete it under a running command."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file():
            try:
                os.link(f, dst / f.name)
            except OSError:
                shutil.copy2(f, dst / f.name)
    return dst


def _kill(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


async def run_command(command: list[str], values: dict[str, str], timeout_s: float) -> dict[str, Any]:
    argv = [part.format(**values) for part in command]
    env = {**os.environ, **{f"MILES_EVAL_{k.upper()}": v for k, v in values.items()}}
    try:
        proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True)
    except OSError as exc:
        raise ExternalEvalError(f"eval.external.command {argv[0]!r} could not start: {exc}") from exc
    try:
        async with asyncio.timeout(timeout_s):
            out, err = await proc.communicate()
    except TimeoutError:
        _kill(proc)
        await proc.wait()
        raise ExternalEvalError(f"eval.external.command timed out after {timeout_s:g}s (killed)") from None
    except BaseException:
        _kill(proc)
        await proc.wait()
        raise
    finally:
        _kill(proc)  # children it left behind in its process group
    stderr = err.decode(errors="replace")[-TAIL:]
    if proc.returncode:
        raise ExternalEvalError(f"eval.external.command exited with {proc.returncode}: {stderr.strip()}")
    output = Path(values["output"])
    text = output.read_text(encoding="utf-8") if output.is_file() else \
        next((ln for ln in reversed(out.decode(errors="replace").splitlines()) if ln.strip()), "")
    try:
        result = json.loads(text)
    except ValueError as exc:
        raise ExternalEvalError(f"eval.external.command wrote no JSON result to {output} nor as its last stdout "
                                f"line (got {text[:200]!r})") from exc
    if not isinstance(result, dict) or not ({"tasks", "metrics"} & set(result)):
        raise ExternalEvalError(f"eval.external.command result must be a JSON object with 'tasks' and/or "
                                f"'metrics', got {text[:200]!r}")
    return result


def parse_result(result: dict[str, Any], threshold: float) -> tuple[list[AttemptRecord], dict[str, float]]:
    """Per-task records (an entry with an ``error`` or without a reward is an error) and the
    numeric ``metrics`` as ``eval/external/<name>``."""
    records: list[AttemptRecord] = []
    counts: dict[str, int] = {}
    for i, row in enumerate(result.get("tasks") or []):
        if not isinstance(row, dict) or "task_id" not in row:
            raise ExternalEvalError(f"eval.external.command result: tasks[{i}] needs a 'task_id', got {row!r:.200}")
        task_id = str(row["task_id"])
        attempt = int(row.get("attempt", counts.get(task_id, 0)))
        counts[task_id] = attempt + 1
        reward = row.get("reward")
        if row.get("error") or not isinstance(reward, int | float) or not math.isfinite(reward):
            records.append(AttemptRecord(task_id, attempt, None, None, str(row.get("error") or "no reward"),
                                         "external"))
            continue
        passed = bool(row["passed"]) if "passed" in row else float(reward) >= threshold
        records.append(AttemptRecord(task_id, attempt, float(reward), passed))
    metrics = {f"eval/external/{k}": float(v) for k, v in (result.get("metrics") or {}).items()
               if isinstance(v, int | float) and not isinstance(v, bool)}
    return records, metrics
