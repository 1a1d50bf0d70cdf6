"""A training run's state and the small verbs the driver calls (warm start, push, next groups,
train, checkpoint, log), over the components :func:`~miles_engine.run.compose.compose` built."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from miles_engine import checkpoint
from miles_engine.checkpoint import consumed, crash_points, resume
from miles_engine.evaluation.splits import resume_split_change
from miles_engine.metrics import keys as K
from miles_engine.precision.config import PrecisionGapError
from miles_engine.rollout.types import Group
from miles_engine.run.compose import Components
from miles_engine.run.record_advantages import driver_advantages
from miles_engine.run.step_metrics import EngineStepMetrics, group_metrics, sandbox_step_metrics
from miles_engine.sft.config import SFTInputs
from miles_engine.sft.warm_start import run_sft

_UNPREFIXED = ("opd/", "tis/", "precision/", "draft/")  # trainer metrics the report reads under their own names


class TrainingRun:
    def __init__(self, parts: Components) -> None:
        self.parts = parts
        self.cfg, self.run_dir = parts.cfg, parts.run_dir
        self.mode = parts.mode
        self.step = 0
        self.current_step = 0  # the step in progress (crash points, weight publish)
        self.stop_requested = False  # set by Ctrl-C: finish the current step, checkpoint, stop
        self.started = time.monotonic()
        self.timers: dict[str, float] = {}
        self.saved_step: int | None = None  # the step of the newest checkpoint on disk
        self.checkpoint_metrics: dict[str, float] = {}
        self.offload_figures: dict[str, float] = {}  # the last trainer.offload: bytes per kind, seconds
        self.last_push: Any = None
        self.recorded_bodies: set[tuple[str, int]] = set()  # this step's trajectories whose body is recorded
        self.record_metrics: dict[str, float] = {}
        engines = [s.engine for s in parts.engines.slots]
        self.engine_metrics = EngineStepMetrics(engines[0] if len(engines) == 1 else parts.engines)

    async def restore(self) -> TrainingRun:
        """Trainer (model, optimizer, schedule, weight version), buffered groups, RNGs, step; the
        initial push then brings the engines to these weights under this version."""
        loaded = self.parts.resumed
        if loaded is None:
            return self
        t0 = time.perf_counter()
        draft_state = loaded.trainer_state.pop("draft", None)
        await self.parts.trainer.load_state_dict(loaded.trainer_state)
        loaded.trainer_state = {}  # free it
        self._restore_draft(draft_state)
        self.parts.buffer.restore(loaded.rollout.buffered)
        consumed.truncate_after(self.run_dir, loaded.step)
        if self.parts.trajectories is not None:
            await asyncio.to_thread(self.parts.trajectories.resume_at, loaded.step)
        checkpoint.set_rng_states(loaded.rng)
        self.step = self.current_step = self.saved_step = self.parts.progress.step = loaded.step
        self.checkpoint_metrics["checkpoint/restore_s"] = time.perf_counter() - t0 + loaded.load_s
        print(f"resumed from {loaded.path}: step {loaded.step}, weight version {self.version}, data cursor "
              f"{loaded.rollout.cursor}, {len(loaded.rollout.buffered)} buffered group(s) restored, "
              f"{len(loaded.rollout.requeued)} running group(s) requeued")
        return self

    def _restore_draft(self, state: dict[str, Any] | None) -> None:
        """The co-trained draft resumes where it was; a checkpoint without one (``speculative.train``
        turned on at resume) or with another draft starts it from its source, said here."""
        draft = self.parts.draft
        if draft is None:
            return
        if state is None or state.get("source") != draft.source:
            held = "no co-trained draft" if state is None else f"the co-trained draft {state.get('source')}"
            print(f"the checkpoint holds {held}: {draft.source} starts from its own weights")
            return
        draft.load_state_dict(state)

    @property
    def version(self) -> int:
        return self.parts.trainer.weight_version

    def steps(self) -> range:
        return range(self.step + 1, self.cfg.run.steps + 1)

    def should_stop(self) -> bool:
        limit = self.cfg.run.max_minutes
        return self.stop_requested or (limit is not None and time.monotonic() - self.started > limit * 60)

    async def warm_start(self) -> None:
        if self.parts.opd is not None:
            await self.parts.opd.prepare(stop=lambda: self.stop_requested)
        p = self.parts
        if self.cfg.sft.enabled and p.resumed is None:  # a fresh run, or one stopped during SFT
            await run_sft(SFTInputs(cfg=self.cfg, trainer=p.trainer, codec=p.codec, source=p.source,
                                    metrics=p.metrics, stop=lambda: self.stop_requested, run_dir=self.run_dir,
                                    tokenizer_sha=p.tokenizer_sha, policy=p.policy, resume_sft=p.resume_sft,
                                    resume_rules=(resume_split_change,)))

    async def evaluate(self, step: int, version: int) -> None:
        """Every ``eval.every`` steps: shared, dedicated or external (eval/*, RUN_DIR/eval/)."""
        await self.parts.evaluator.after_step(step, version)

    async def push_weights(self) -> int:
        t0 = time.perf_counter()
        tensors = await self.parts.trainer.export_for_push()  # rank 0's export stays there (Ray, broadcast)
        if self.parts.draft is not None:  # the co-trained draft goes along, as draft.<name>
            tensors = self.parts.draft.with_policy(tensors)
        crash_points.crash_point("weight_publish", self.current_step)
        async with self.parts.engines.weights_held():  # no engine is re-admitted with older weights meanwhile
            self.last_push = await self.parts.transport.push(tensors, self.version)
            self.parts.trainer.record_push(tensors, self.last_push.version)
        self.timers["push"] = time.perf_counter() - t0
        self.offload_figures = await self.parts.trainer.offload()  # idle until the next step (trainer.offload)
        if self.offload_figures:
            crash_points.crash_point("trainer_offloaded", self.current_step)
        return self.last_push.version

    async def next_groups(self, step: int) -> list[Group]:
        self.current_step = step
        crash_points.crash_point("generation", step)
        t0 = time.perf_counter()
        get = asyncio.ensure_future(self.parts.buffer.get(self.cfg.rollout.groups_per_step, self.version))
        try:
            while not get.done():  # the fleet is watched while the step waits for its groups
                await asyncio.wait([get], timeout=1.0)
                self.parts.engines.raise_if_unhealthy_for(self.cfg.fleet.unhealthy_timeout_s,
                                                         key="fleet.unhealthy_timeout_s")
        finally:
            get.cancel()
        groups = get.result()
        if self.parts.opd is not None:
            self.parts.opd.check()  # a sample no teacher route covers stops the run
        self.timers["wait"] = time.perf_counter() - t0
        return groups

    async def train(self, step: int, groups: list[Group]) -> dict[str, float]:
        crash_points.crash_point("train_step", step)
        t0 = time.perf_counter()
        recorder = self.parts.trajectories
        self.recorded_bodies = recorder.bodies(step, groups) if recorder is not None else set()
        drafting = asyncio.ensure_future(self._train_draft(groups))  # beside the policy's step (its own process)
        try:
            # the trainer returns its log-probs of the rows whose body is recorded
            metrics = await self.parts.trainer.train_step(groups, record=self.recorded_bodies if recorder else None)
            self.timers["train"] = time.perf_counter() - t0
        finally:
            draft_metrics = await drafting
        metrics.update(draft_metrics)
        await self._check_precision_gap(step, groups, metrics)
        await asyncio.to_thread(consumed.append, self.run_dir, step, self.version, [g.group_id for g in groups])
        return metrics

    async def _train_draft(self, groups: list[Group]) -> dict[str, float]:
        """The co-trained speculative draft's step on the policy's samples (``draft/*``)."""
        if self.parts.draft is None:
            return {}
        t0 = time.perf_counter()
        metrics = await asyncio.to_thread(self.parts.draft.train_step, groups)
        self.timers[K.TIME_TRAIN_DRAFT.removeprefix("time/")] = time.perf_counter() - t0
        return metrics

    async def _check_precision_gap(self, step: int, groups: list[Group], metrics: dict[str, float]) -> None:
        """A quantised run's figures under ``precision/`` (the gap on tokens of the current weights, so
        staleness does not enter; the importance ratio's spread), and the stop at ``max_logprob_gap``."""
        p = self.cfg.precision
        gap = metrics.get("tis/numerics_abs_diff")
        if (p.quantised or p.train != "full") and gap is not None:
            metrics[K.PRECISION_GAP_MEAN] = gap
            metrics[K.PRECISION_GAP_MAX] = metrics["tis/numerics_max_abs_diff"]
            if K.TIS_RATIO_MAX in metrics:
                metrics[K.PRECISION_RATIO_SPREAD] = metrics[K.TIS_RATIO_MAX] - metrics[K.TIS_RATIO_MIN]
        if p.max_logprob_gap is None or gap is None or gap <= p.max_logprob_gap:
            return
        fmt = p.rollout if p.rollout != "full" else p.train
        gaps = await self.parts.trainer.precision_gaps(groups, fmt, p.exceptions) if fmt != "full" else None
        if gaps:
            worst = next(iter(gaps))
            top = ", ".join(f"{c} {g:.4g}" for c, g in list(gaps.items())[:3])
            why = (f"quantising {worst} alone moves the trainer's log-probs by {gaps[worst]:.4g} on this step's "
                   f"tokens (largest first: {top}); keep it in high precision: precision.exceptions ['*{worst.split('.')[-1]}*']")
        else:
            why = ("no tensor class to name: " + ("the rollout is not quantised, so the gap is not the format's"
                                                  if fmt == "full" else "the trainer backend has no diagnosis"))
        raise PrecisionGapError(f"step {step}: the mean |trainer - engine| log-prob on the sampled tokens of the "
                                f"current weights is {gap:.4g}, above precision.max_logprob_gap={p.max_logprob_gap}; "
                                f"{why}")

    async def maybe_checkpoint(self, step: int, *, final: bool = False) -> None:
        """Every ``run.checkpoint_every`` steps (step 0 included: resumable from the first RL
        step) and at the end; never twice for one step."""
        every = self.cfg.run.checkpoint_every
        if self.saved_step == step or not (final or (every and step % every == 0)):
            return
        p = self.parts
        t0 = time.perf_counter()
        # taken now, on the event loop, so the buffer and the running groups are one consistent cut
        rollout = checkpoint.RolloutState(p.scheduler.next_position, p.buffer.snapshot(), p.scheduler.unfinished())
        rng = checkpoint.rng_states()
        staged = None
        if p.trainer.checkpoint_shards:  # the ranks write their shards into the staged checkpoint themselves
            staged = await asyncio.to_thread(checkpoint.stage, self.run_dir, step)
            state = await p.trainer.save_shards(staged / p.trainer.checkpoint_shards)
            crash_points.crash_point("checkpoint_write", step)  # test hook: shards written, nothing else
        else:
            state = await p.trainer.state_dict()
        if p.draft is not None:
            state = {**state, "draft": p.draft.state_dict()}
        t1 = time.perf_counter()
        info = resume.manifest_info(self.cfg.model_dump(mode="json"), p.tokenizer_sha, self.version, rollout)
        path = await asyncio.to_thread(checkpoint.save, self.run_dir, step=step, trainer_state=state, rollout=rollout,
                                       rng=rng, manifest=info, keep=self.cfg.run.checkpoint_keep,
                                       staged=staged)
        self.saved_step = step
        self.checkpoint_metrics.update({"checkpoint/write_s": time.perf_counter() - t0,
                                        "checkpoint/state_s": t1 - t0,
                                        "checkpoint/bytes": float(sum(f.stat().st_size for f in path.rglob("*")
                                                                      if f.is_file()))})

    async def record_trajectories(self, step: int, groups: list[Group]) -> None:
        """RUN_DIR/trajectories.mtr: this step's trajectories (and those dropped meanwhile), written
        off the event loop; its cost goes into the step's time split."""
        recorder = self.parts.trajectories
        if recorder is None:
            return
        t0 = time.perf_counter()
        rows = self.parts.trainer.step_rows
        trainer_cfg = self.cfg.trainer
        # trainer ranks elsewhere report rank 0's rows or none: the others' advantages are computed here
        covered = all((t.group_id, t.index) in rows for g in groups for t in g.trajectories)
        fallback = {} if covered or trainer_cfg.opd.beta else driver_advantages(groups, trainer_cfg.algorithm,
                                                                                trainer_cfg.opd.task_reward)
        done = await asyncio.to_thread(recorder.write_step, step, self.version, groups, self.recorded_bodies, rows,
                                       fallback)
        self.timers[K.TIME_RECORD.removeprefix("time/")] = time.perf_counter() - t0
        self.record_metrics = {K.TRAJECTORY_RECORDS: float(done.records), K.TRAJECTORY_BYTES: float(done.bytes)}

    def log(self, step: int, groups: list[Group], train_metrics: dict[str, float]) -> None:
        p = self.parts
        self.step = p.progress.step = step
        metrics = {**group_metrics(groups),
                   **{k if k.startswith(_UNPREFIXED) else f"train/{k}": v for k, v in train_metrics.items()}}
        metrics.update(p.buffer.metrics(self.version))
        metrics.update(p.scheduler.metrics())
        metrics.update(self.mode.metrics())
        metrics.update(self.last_push.metrics())
        metrics.update(self.engine_metrics.metrics())
        metrics.update(sandbox_step_metrics(p.sandboxes))
        metrics.update(p.engines.metrics())
        if p.placement is not None:  # placement.backend=ray: actors, placement groups, actor restarts
            metrics.update(p.placement.metrics())
        metrics.update({f"time/{k}": v for k, v in self.timers.items()})
        metrics.update(self.checkpoint_metrics)
        self.checkpoint_metrics = {}
        metrics.update({f"train/{k}": v for k, v in self.offload_figures.items()})
        metrics.update(self.record_metrics)
        metrics["time/elapsed"] = time.monotonic() - self.started
        p.metrics.log(step, metrics)
        p.samples.write(step, self.version, groups)
