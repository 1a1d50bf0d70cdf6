"""Crash-safe checkpoints: one directory per RL step under ``RUN_DIR/checkpoints/``.

    step_00000012/
      trainer.pt     model, optimizer(s), LR schedule(s), weight version, step counters
      rollout.pkl    data cursor, finished-but-unconsumed groups, requeued running groups
      rng.pkl        python / numpy / torch RNG states of the driver process (the engine samples there)
      manifest.json  step, weight version, recipe fingerprint + config, parallel layout, file sizes
      megatron_dist/ (trainer.megatron.checkpoint_format=dist) every trainer rank's shards, written
                     by the ranks in parallel into the staged directory (:func:`stage`); trainer.pt
                     then holds only the small rest and names this directory

A checkpoint is written into ``.tmp-step_NNNNNNNN-<pid>/``: every file fsynced, the manifest
last, the directory fsynced, then renamed into place and the parent fsynced. A crash at any
point leaves either the previous checkpoints only (plus a temporary directory, removed by the
next save or resume) or the new one complete: never a half checkpoint. The last ``keep`` are
kept.

Groups still *running* when the checkpoint is taken are not persisted: they are requeued.
Their ``(position, task_id)`` is recorded and a resumed scheduler submits those tasks first,
under the same group ids, before continuing the task stream at the cursor. So every group of
the data order is trained exactly once across any number of crashes (see ``consumed.jsonl``).
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import random
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_engine.errors import ConfigError
from miles_engine.rollout.types import Group
from miles_engine.checkpoint.crash_points import crash_point
from miles_engine.checkpoint.durable import fsync_dir, write_bytes

log = logging.getLogger(__name__)
FORMAT = 2
_NAME = re.compile(r"^step_(\d{8})$")
_TMP = ".tmp-"
FILES = ("trainer.pt", "rollout.pkl", "rng.pkl")


@dataclass
class RolloutState:
    cursor: int  # stream position of the next new task
    buffered: list[Group] = field(default_factory=list)  # finished, not yet trained on: persisted
    requeued: list[tuple[int, str]] = field(default_factory=list)  # (position, task_id) running: regenerated


@dataclass
class Loaded:
    path: Path
    manifest: dict[str, Any]
    trainer_state: dict[str, Any]
    rollout: RolloutState
    rng: dict[str, Any]
    load_s: float = 0.0  # how long reading and checking it took (checkpoint/restore_s)

    @property
    def step(self) -> int:
        return int(self.manifest["step"])


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = checkpoint_dir(run_dir)
    return sorted(p for p in root.iterdir() if _NAME.match(p.name) and p.is_dir()) if root.is_dir() else []


def latest(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def remove_partial(run_dir: Path) -> None:
    """Delete temporary directories left by a crash in the middle of a save."""
    root = checkpoint_dir(run_dir)
    for tmp in (p for p in root.iterdir() if p.name.startswith(_TMP)) if root.is_dir() else []:
        log.warning("checkpoint: removing %s, a checkpoint whose write was interrupted", tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def rng_states() -> dict[str, Any]:
    import torch

    states: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        states["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    import torch

    random.setstate(states["python"])
    torch.set_rng_state(states["torch"])
    if "numpy" in states:
        import numpy as np

        np.random.set_state(states["numpy"])


def stage(run_dir: Path, step: int) -> Path:
    """The temporary directory checkpoint ``step`` is written into (created empty): the trainer's
    ranks may write their shards into a subdirectory of it before :func:`save` completes it."""
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    remove_partial(run_dir)
    tmp = root / f"{_TMP}step_{step:08d}-{os.getpid()}"
    tmp.mkdir()
    return tmp


def _staged_files(tmp: Path) -> dict[str, int]:
    """Files the trainer ranks wrote into subdirectories of ``tmp`` (fsynced here), with their sizes."""
    out = {}
    for sub in sorted(p for p in tmp.iterdir() if p.is_dir()):
        for f in sorted(p for p in sub.rglob("*") if p.is_file()):
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
            out[str(f.relative_to(tmp))] = f.stat().st_size
        fsync_dir(sub)
    return out


def save(run_dir: Path, *, step: int, trainer_state: dict[str, Any], rollout: RolloutState,
         rng: dict[str, Any], manifest: dict[str, Any], keep: int, staged: Path | None = None) -> Path:
    """Write checkpoint ``step`` atomically (see the module doc); prune to the last ``keep``.
    ``staged``: the :func:`stage` directory the trainer's shards are already in."""
    import torch

    root = checkpoint_dir(run_dir)
    final = root / f"step_{step:08d}"
    tmp = staged if staged is not None else stage(run_dir, step)
    sharded = _staged_files(tmp)
    buf = io.BytesIO()
    torch.save(trainer_state, buf)
    payloads = {"trainer.pt": buf.getvalue(), "rollout.pkl": pickle.dumps(rollout, protocol=5),
                "rng.pkl": pickle.dumps(rng, protocol=5)}
    for name, data in payloads.items():
        write_bytes(tmp / name, data)
        crash_point("checkpoint_write", step)  # test hook: a crash with some files written
    body = {**manifest, "format": FORMAT, "step": step, "created": time.time(),
            "files": {**sharded, **{name: len(data) for name, data in payloads.items()}}}
    write_bytes(tmp / "manifest.json", json.dumps(body, indent=1, sort_keys=True, default=str).encode())
    fsync_dir(tmp)
    if final.exists():  # the same step saved again (e.g. the final checkpoint): replace it whole
        old = root / f"{_TMP}old-{final.name}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    fsync_dir(root)
    for stale in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(stale)
    return final


def load(path: Path) -> Loaded:
    """Read and check one checkpoint directory; one :class:`ConfigError` naming what is wrong."""
    import torch

    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise ConfigError(f"checkpoint {path} has no manifest.json: not a complete checkpoint (delete it to resume "
                          f"from the previous one)")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("format") != FORMAT:
        raise ConfigError(f"checkpoint {path}: format {manifest.get('format')!r}, this version reads {FORMAT}")
    for name, size in manifest["files"].items():
        actual = (path / name).stat().st_size if (path / name).is_file() else None
        if actual != size:
            raise ConfigError(f"checkpoint {path}: {name} is {actual} bytes, the manifest says {size} "
                              f"(damaged; delete this checkpoint to resume from the previous one)")
    state = torch.load(path / "trainer.pt", map_location="cpu", weights_only=False)
    if state.get("dist_checkpoint"):  # Megatron's distributed format: the ranks read it from here
        state["dist_checkpoint_path"] = str(path / state["dist_checkpoint"])
    check_trainer_state(state, path)
    rollout = pickle.loads((path / "rollout.pkl").read_bytes())
    rng = pickle.loads((path / "rng.pkl").read_bytes())
    return Loaded(path, manifest, state, rollout, rng)


def check_trainer_state(state: dict[str, Any], path: Path) -> None:
    """Never restart Adam from zero silently: the optimizer state must be there once steps were taken."""
    for key in ("model", "optimizer", "scheduler", "weight_version"):
        if key not in state or state[key] is None:
            raise ConfigError(f"checkpoint {path}/trainer.pt has no '{key}' state: refusing to resume (a missing "
                              f"optimizer would silently restart Adam from zero)")
    rl_steps, sft_steps = int(state.get("rl_steps", 0)), int(state.get("sft_steps", 0))
    shared = "sft_optimizer" not in state  # SFT stepped the RL optimizer itself
    expected = {"optimizer": rl_steps + (sft_steps if shared else 0), "sft_optimizer": 0 if shared else sft_steps}
    dist = state.get("dist_checkpoint")
    if dist and not (path / dist / "metadata.json").is_file():
        raise ConfigError(f"checkpoint {path}: its Megatron distributed shards ({dist}/) are missing or incomplete "
                          f"(no metadata.json): delete this checkpoint to resume from the previous one")
    for key, steps in expected.items():
        # Megatron's distributed format keeps the moments in the shards; "step" says they were written
        moments = (state.get(key) or {}).get("step" if dist else "state")
        if steps > 0 and not moments:
            raise ConfigError(f"checkpoint {path}/trainer.pt records {steps} steps of '{key}' but its state is "
                              f"empty: refusing to resume with Adam's moments reset to zero")


def load_latest(run_dir: Path) -> Loaded:
    remove_partial(run_dir)
    path = latest(run_dir)
    if path is None:
        raise ConfigError(f"--resume {run_dir}: no checkpoint under {checkpoint_dir(run_dir)}")
    return load(path)
