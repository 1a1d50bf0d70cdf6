"""SFT on ``sft.dataset`` transcripts: the step schedule, held-out eval loss, SFT checkpoints and
exact resume.

SFT checkpoints use the RL checkpoint format under ``RUN_DIR/sft/checkpoints/step_N`` (the
cursor is the SFT step). The end of SFT is the RL run's step-0 checkpoint, so a run resumes
SFT only while it has SFT checkpoints and no RL one. A resumed SFT run restores the trainer
(model, optimizer, schedule), the RNGs and the step, and replays the same schedule from there:
its weights equal an uninterrupted run's.
"""

from __future__ import annotations

import asyncio
import copy
import time
from pathlib import Path
from typing import Any

from miles_engine import checkpoint
from miles_engine.checkpoint import resume
from miles_engine.checkpoint.compat import check, flatten
from miles_engine.errors import ConfigError
from miles_engine.sft.config import SFTInputs
from miles_engine.sft.dataset import SFTData, export_demonstrations, load_sft_data, schedule
from miles_engine.trainer.rows import SFTRow

_MAY_CHANGE = ("max_minutes", "dataset.eval_every", "dataset.checkpoint_every")


def sft_root(run_dir: Path) -> Path:
    return run_dir / "sft"


def resumes_sft(run_dir: Path) -> bool:
    """``--resume``: SFT was stopped before its end (SFT checkpoints, no RL checkpoint yet)."""
    return checkpoint.latest(run_dir) is None and checkpoint.latest(sft_root(run_dir)) is not None


class EvalLoss:
    """Token-mean NLL of the held-out rows under the trainer's current weights (a copy of the
    policy in this process, so it works with either trainer placement)."""

    def __init__(self, policy: Any, rows: list[tuple[list[int], list[int]]], batch_rows: int = 16) -> None:
        self.policy, self.rows, self.batch_rows = policy, rows, batch_rows
        self.model: Any = None

    def _model(self) -> Any:
        if self.model is None:
            base = self.policy
            if isinstance(base, str):
                from transformers import AutoModelForCausalLM

                base = AutoModelForCausalLM.from_pretrained(base)
            self.model = copy.deepcopy(base).eval()
        return self.model

    def loss(self, tensors: list[tuple[str, Any]]) -> float:
        import torch

        from miles_engine.trainer.models import forward_logprobs

        model = self._model()
        with torch.no_grad():
            state = {name: t.detach().clone() for name, t in tensors}
            model.load_state_dict(state, strict=False)
            total, count = 0.0, 0
            for i in range(0, len(self.rows), self.batch_rows):
                chunk = self.rows[i:i + self.batch_rows]
                width = max(len(ids) for ids, _ in chunk)
                ids = torch.zeros((len(chunk), width), dtype=torch.long)
                attn = torch.zeros_like(ids)
                mask = torch.zeros((len(chunk), width))
                for r, (row_ids, row_mask) in enumerate(chunk):
                    ids[r, :len(row_ids)] = torch.tensor(row_ids)
                    attn[r, :len(row_ids)] = 1
                    mask[r, :len(row_mask)] = torch.tensor(row_mask, dtype=torch.float)
                out = forward_logprobs(model, ids, attn, mask=mask)
                total += float((-out.logp * mask).sum())
                count += int(mask.sum())
        return total / max(count, 1)


def _manifest(inputs: SFTInputs, data: SFTData, steps: int, step: int) -> dict[str, Any]:
    config = inputs.cfg.model_dump(mode="json")
    info = resume.manifest_info(config, inputs.tokenizer_sha, inputs.trainer.weight_version,
                                checkpoint.RolloutState(cursor=step))
    info["sft"] = {"digest": data.digest, "steps": steps, "config": config["sft"]}
    return info


def _check_same_sft(saved: dict[str, Any], now: dict[str, Any], path: Path) -> None:
    old, new = flatten(saved["config"]), flatten(now["config"])
    diffs = [f"  sft.{k}: checkpoint {old.get(k)!r}, now {new.get(k)!r}" for k in sorted(set(old) | set(new))
             if old.get(k) != new.get(k) and not k.startswith(_MAY_CHANGE)]
    if saved["digest"] != now["digest"]:
        diffs.append("  the transcripts' token rows differ (the data file or the tokenizer changed)")
    if diffs:
        raise ConfigError(f"cannot resume SFT from {path}: it was written with different SFT data or settings\n"
                          + "\n".join(diffs))


async def _restore(inputs: SFTInputs, data: SFTData, steps: int) -> int:
    loaded = await asyncio.to_thread(checkpoint.load_latest, sft_root(_run_dir(inputs)))
    check(loaded.manifest, inputs.cfg.model_dump(mode="json"), inputs.tokenizer_sha, loaded.path,
          rules=inputs.resume_rules)
    _check_same_sft(loaded.manifest["sft"], _manifest(inputs, data, steps, 0)["sft"], loaded.path)
    await inputs.trainer.load_state_dict(loaded.trainer_state)
    checkpoint.set_rng_states(loaded.rng)
    print(f"resumed SFT from {loaded.path}: step {loaded.step} of {steps}")
    return loaded.step


async def _save(inputs: SFTInputs, data: SFTData, steps: int, step: int) -> None:
    state = await inputs.trainer.state_dict()
    rng = checkpoint.rng_states()
    await asyncio.to_thread(checkpoint.save, sft_root(_run_dir(inputs)), step=step, trainer_state=state,
                            rollout=checkpoint.RolloutState(cursor=step), rng=rng,
                            manifest=_manifest(inputs, data, steps, step), keep=inputs.cfg.run.checkpoint_keep)


def _run_dir(inputs: SFTInputs) -> Path:
    if inputs.run_dir is None:
        raise ConfigError("sft.dataset needs a run directory (its SFT checkpoints live under RUN_DIR/sft)")
    return inputs.run_dir


async def run_sft_dataset(inputs: SFTInputs) -> None:
    cfg = inputs.cfg.sft
    dcfg = cfg.dataset
    assert dcfg is not None
    await asyncio.to_thread(export_demonstrations, dcfg, inputs.source)
    data = await asyncio.to_thread(load_sft_data, inputs.codec, dcfg)
    if data.bad.count:
        print(data.bad.summary())
    plan = schedule(data.train, epochs=cfg.epochs, batch_size=cfg.batch_size, pack_tokens=dcfg.pack_tokens,
                    seed=inputs.cfg.seed)
    start = await _restore(inputs, data, len(plan)) if inputs.resume_sft else 0
    evaluator = EvalLoss(inputs.policy, data.eval) if data.eval else None
    per_epoch = len(plan) / cfg.epochs
    inputs.metrics.set_total(len(plan), kind="sft")
    started = time.monotonic()
    for step in range(start + 1, len(plan) + 1):
        batch = [SFTRow(*data.train[i]) for i in plan[step - 1]]
        metrics = await inputs.trainer.sft_step(batch)
        metrics.update(epoch=step / per_epoch, rows=float(len(batch)), train_rows=float(len(data.train)),
                       eval_rows=float(len(data.eval)), bad_rows=float(data.bad.count))
        if evaluator is not None and (step == len(plan) or (dcfg.eval_every and step % dcfg.eval_every == 0)):
            metrics["eval_loss"] = await asyncio.to_thread(evaluator.loss, await inputs.trainer.named_tensors())
        inputs.metrics.log(step, {f"sft/{k}": v for k, v in metrics.items()}, kind="sft")
        timed_out = cfg.max_minutes is not None and time.monotonic() - started > cfg.max_minutes * 60
        periodic = dcfg.checkpoint_every and step % dcfg.checkpoint_every == 0
        if step < len(plan) and (inputs.stop() or periodic):
            await _save(inputs, data, len(plan), step)
        if inputs.stop() or timed_out:
            break
    inputs.metrics.set_total(inputs.cfg.run.steps, kind="train")
