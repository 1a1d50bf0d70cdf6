"""LoRA resume is exact: a trainer process is SIGKILLed after writing a checkpoint (the training
stack's own ``checkpoint.save``); a fresh process loads it (adapters + Adam + schedule) and its
next RL step equals the step of an uninterrupted run, bit for bit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

from miles_engine import checkpoint
from miles_engine.trainer.torch_trainer import TorchTrainer
from tests.trainer.helpers import TINY, random_groups

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]
CONFIG = {"lora": {"enabled": True, "rank": 4, "alpha": 8, "target_modules": "all-linear"},
          "optimizer": {"lr": 1e-2, "weight_decay": 0.01},
          "lr_schedule": {"kind": "linear", "warmup_steps": 1, "total_steps": 10}}
WORKER = textwrap.dedent("""
    import sys, time, torch
    torch.set_num_threads(1)
    from miles_engine import checkpoint
    from miles_engine.trainer.torch_trainer import TorchTrainer
    from tests.trainer.test_lora_resume import CONFIG, TINY, groups
    trainer = TorchTrainer(dict(TINY), CONFIG)
    for step in (1, 2):
        trainer.train_step(groups(step))
    checkpoint.save(__import__("pathlib").Path(sys.argv[1]), step=2, trainer_state=trainer.state_dict(),
                    rollout=checkpoint.RolloutState(cursor=0), rng=checkpoint.rng_states(), manifest={}, keep=2)
    print("CHECKPOINTED", flush=True)
    while True:  # keeps training until killed
        trainer.train_step(groups(3))
        time.sleep(0.01)
""")


def groups(step: int):
    return random_groups(2, 4, seed=100 + step)


def _adapters(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.policy.named_parameters() if p.requires_grad}


def test_sigkill_after_checkpoint_then_resume_equals_uninterrupted(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    try:
        deadline = time.monotonic() + 300  # a safety stop only
        line = b""
        while b"CHECKPOINTED" not in line and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
        assert b"CHECKPOINTED" in line, proc.stdout.read().decode()[-3000:]
        time.sleep(0.3)  # mid-way through a later step
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL

    loaded = checkpoint.load_latest(tmp_path)
    assert loaded.step == 2
    saved = loaded.trainer_state["model"]
    assert saved and all(".lora_" in k for k in saved)  # adapters only, not the frozen base
    assert loaded.trainer_state["optimizer"]["state"]  # Adam's moments are there
    resumed = TorchTrainer(dict(TINY), CONFIG)
    resumed.load_state_dict(loaded.trainer_state)
    after_resume = resumed.train_step(groups(3))

    straight = TorchTrainer(dict(TINY), CONFIG)
    for step in (1, 2):
        straight.train_step(groups(step))
    uninterrupted = straight.train_step(groups(3))

    a, b = _adapters(resumed), _adapters(straight)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.weight_version == straight.weight_version == 3
    for key in ("loss", "grad_norm", "lr"):
        assert after_resume[key] == uninterrupted[key], key
    pushed_a, pushed_b = dict(resumed.named_tensors()), dict(straight.named_tensors())
    assert all(torch.equal(pushed_a[k], pushed_b[k]) for k in pushed_a)
