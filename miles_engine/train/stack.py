"""Builds every component a training run needs from a recipe, and tears them down.

The driver loop only calls this object's small verbs (``warm_start``, ``push_weights``,
``next_groups``, ``train``, ``maybe_checkpoint``, ``log``); every variant (placement,
rollout mode, transport) is decided here once, at build time.
"""

from __future__ import annotations

import asyncio
import copy
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from miles_engine.config.recipe import RecipeConfig
from miles_engine.errors import ConfigError
from miles_engine.hub import Hub
from miles_engine.rollout.types import Group
from miles_engine.sandbox.remote import RUN_ID_ENV
from miles_engine.train import checkpoint, consumed, crash_points, resume
from miles_engine.train.checkpoint_compat import check as check_resume
from miles_engine.train.engine_metrics import EngineStepMetrics
from miles_engine.train.group_metrics import group_metrics


async def _set_switch_interval(seconds: float) -> None:
    sys.setswitchinterval(seconds)


def bootstrap_codec(hub: Hub, cfg: RecipeConfig) -> Any:
    """A codec good enough to render text (the policy tokenizer is trained on that text)."""
    from miles_engine.tito import make_codec, resolve_family

    family = resolve_family(cfg.chat_family.name, cfg.chat_family.options, hub)
    return make_codec(family, f"builtin:bpe-{family.name}" if family.name in ("chatml", "qwen3", "glm")
                      else "builtin:bpe-chatml")


def demonstrations(source: Any, n: int, seed: int, wrong_fraction: float | None = None) -> list[Any]:
    make = getattr(source, "demonstrations", None)
    if make is None:
        raise ConfigError(f"environment '{getattr(source, 'name', source)}' provides no demonstrations: set "
                          f"tokenizer.path (a trained tokenizer) and sft.enabled=false, or pick an environment "
                          f"with demonstrations (e.g. shell-drills)")
    return list(make(n, seed=seed, wrong_fraction=wrong_fraction))


_UNPREFIXED = ("opd/", "tis/")  # trainer metrics the report reads under their own names


class TrainingStack:
    def __init__(self, cfg: RecipeConfig, run_dir: Path, *, hub: Hub | None = None, resume: bool = False) -> None:
        self.cfg, self.run_dir, self.hub, self.resume = cfg, run_dir, hub or Hub(), resume
        self.step = 0
        self.stop_requested = False  # set by Ctrl-C: finish the current step, checkpoint, stop
        self.started = time.monotonic()
        self.timers: dict[str, float] = {}
        self.current_step = 0  # the step in progress (crash points, weight publish)
        self.resumed: checkpoint.Loaded | None = None
        self.saved_step: int | None = None  # the step of the newest checkpoint on disk
        self.checkpoint_metrics: dict[str, float] = {}
        self._closers: list[Any] = []

    # ------------------------------------------------------------------ build
    async def build(self) -> TrainingStack:
        from miles_engine.metrics import MetricsLogger
        from miles_engine.metrics.samples import SampleLog
        from miles_engine.rollout.buffer import AsyncBuffer
        from miles_engine.rollout.modes import create_mode, validate_mode
        from miles_engine.rollout.scheduler import Scheduler, SchedulerOptions
        from miles_engine.rollout.tasks import TaskStream

        cfg, hub = self.cfg, self.hub
        crash_points.check_env()
        if self.resume:  # read and check it first: a bad checkpoint fails before anything starts
            import torch  # noqa: F401 - imported anyway; kept out of the load time

            t0 = time.perf_counter()
            self.resumed = await asyncio.to_thread(checkpoint.load_latest, self.run_dir)
            self.checkpoint_metrics["checkpoint/load_s"] = time.perf_counter() - t0
        cfg.trainer.check_group_size(cfg.rollout.group_size, "rollout.group_size")
        self.buffer = AsyncBuffer(cfg.buffer, on_reward_error=cfg.reward.on_error)
        validate_mode(cfg.rollout.mode, colocated=cfg.placement.colocated,
                      groups_per_step=cfg.rollout.groups_per_step, buffer=self.buffer)
        self.source = hub.create("environment", cfg.environment.name, cfg.environment.options,
                                 where="environment.options")
        from miles_engine.environments.capabilities import close_environment

        self._closers.append(lambda: close_environment(self.source))
        # remote sandboxes carry the run name as their `miles.run` label: `miles sandbox sweep --run NAME`
        os.environ.setdefault(RUN_ID_ENV, self.run_dir.name)
        self.backend = hub.create("sandbox", cfg.sandbox.backend, cfg.sandbox.options, where="sandbox.options")
        self._closers.append(self.backend.aclose)
        self.tasks = TaskStream(self.source, seed=cfg.rollout.task_seed)
        self._preflight_sandbox()
        self.codec = self._build_codec()
        self.tokenizer_sha = resume.tokenizer_sha256(self.codec.tokenizer)
        if self.resumed is not None:
            check_resume(self.resumed.manifest, cfg.model_dump(mode="json"), self.tokenizer_sha, self.resumed.path)
        self.model = self._build_model()
        self.trainer = await asyncio.to_thread(self._build_trainer)
        self.engine = await self._build_engine()
        self.engine_metrics = EngineStepMetrics(self.engine)
        self.server = await self._start_server()
        from miles_engine.weights import create_transport

        self.transport = create_transport(cfg.weights.transport, self.engine, check=cfg.weights.check,
                                          **self._transport_options())
        self._closers.insert(0, self.transport.close)
        if self.resumed is not None and hasattr(self.transport, "rewind"):  # disk_delta: drop the abandoned future
            await self.transport.rewind(int(self.resumed.manifest["weight_version"]))
        preflight = getattr(self.transport, "preflight", None)
        if preflight is not None:  # disk_delta: what the trainer exports must match its baseline, before training
            await preflight(await asyncio.to_thread(lambda: list(self.trainer.named_tensors())))
        from miles_engine.train.episodes import EpisodeTrajectories

        from miles_engine.rewards.stack import build_reward_stack

        self.reward = build_reward_stack(hub, cfg.reward)
        if self.reward is not None:
            self._closers.append(self.reward.aclose)
        from miles_engine.teachers.setup import OPDSetup

        self.opd = OPDSetup.build(self)
        if self.opd is not None:
            self._closers.append(self.opd.aclose)
        run = EpisodeTrajectories(self.backend, self._make_agent, self.source, self.reward, after=self.opd)
        opts = SchedulerOptions(group_size=cfg.rollout.group_size, max_inflight=cfg.rollout.max_inflight,
                                episode_timeout_s=cfg.rollout.episode_timeout_s)
        rollout = self.resumed.rollout if self.resumed is not None else checkpoint.RolloutState(cursor=0)
        self.scheduler = Scheduler(self.tasks.iter_from(rollout.cursor), run, self.buffer, opts,
                                   version_fn=lambda: self.engine.weight_version, first_position=rollout.cursor,
                                   requeue=resume.requeued_refs(self.tasks, rollout, self.run_dir))
        self.mode = create_mode(cfg.rollout.mode, self.scheduler, groups_per_step=cfg.rollout.groups_per_step)
        self.metrics = MetricsLogger(self.run_dir, cfg.metrics, total_steps=cfg.run.steps,
                                     run_config=cfg.model_dump(mode="json"))
        self.samples = SampleLog(self.run_dir, cfg.metrics.samples_per_step, self.codec.tokenizer.decode)
        self._closers.append(lambda: asyncio.to_thread(self.samples.close))
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        if self.resumed is not None:
            await self._restore(self.resumed)
        return self

    async def _restore(self, loaded: checkpoint.Loaded) -> None:
        """Trainer (model, optimizer, schedule, weight version), buffered groups, RNGs, step; the
        initial push then brings the engines to these weights under this version."""
        t0 = time.perf_counter()
        await asyncio.to_thread(self.trainer.load_state_dict, loaded.trainer_state)
        loaded.trainer_state = {}  # free it
        self.buffer.restore(loaded.rollout.buffered)
        consumed.truncate_after(self.run_dir, loaded.step)
        checkpoint.set_rng_states(loaded.rng)
        self.step = self.current_step = self.saved_step = loaded.step
        self.checkpoint_metrics["checkpoint/restore_s"] = (time.perf_counter() - t0
                                                           + self.checkpoint_metrics.pop("checkpoint/load_s", 0.0))
        print(f"resumed from {loaded.path}: step {loaded.step}, weight version {self.version}, data cursor "
              f"{loaded.rollout.cursor}, {len(loaded.rollout.buffered)} buffered group(s) restored, "
              f"{len(loaded.rollout.requeued)} running group(s) requeued")

    def _preflight_sandbox(self) -> None:
        """Refuse a backend that cannot isolate the tasks as asked, before anything trains."""
        from miles_engine.environments.capabilities import preflight
        from miles_engine.sandbox.protocol import check_supported

        preflight(self.source, self.cfg.sandbox.backend, self.backend)
        task = self.source.load_task(self.tasks.refs[0].id)
        spec = task.sandbox_spec()
        if spec is not None:
            check_supported(spec, self.backend.capabilities(), backend=self.cfg.sandbox.backend, task=task.id)

    def _build_codec(self) -> Any:
        from miles_engine.tito import make_codec
        from miles_engine.tito.messages import normalize_messages, normalize_tools
        from miles_engine.train.policy_tokenizer import policy_tokenizer

        cfg = self.cfg
        from miles_engine.pretrained.policy import pretrained_codec

        codec = pretrained_codec(self.hub, cfg)  # model.path: the model's own tokenizer and template
        if codec is not None:
            return codec
        texts: list[str] = []
        if not cfg.tokenizer.path:
            boot = bootstrap_codec(self.hub, cfg)
            for d in demonstrations(self.source, cfg.tokenizer.corpus_demos, seed=cfg.seed + 17):
                texts.append(boot.render(normalize_messages(d.conversation()), normalize_tools(d.tools),
                                         add_generation_prompt=False))
        tokenizer = policy_tokenizer(cfg.chat_family.name, texts, cfg.tokenizer)
        return make_codec(cfg.chat_family.name, tokenizer, options=cfg.chat_family.options, hub=self.hub)

    def _build_model(self) -> Any:
        from miles_engine.train.tiny_model import build_config, build_model

        m = self.cfg.model
        if m.path:
            return m.path
        tok = self.codec.tokenizer
        config = build_config(m, tok.vocab_size, bos_id=None, eos_id=self.codec.stop_ids[0],
                              pad_id=tok.added_tokens.get("<|endoftext|>", 0))
        return build_model(config, self.cfg.seed)

    def _build_trainer(self) -> Any:
        from miles_engine.trainer.distributed import FSDPTrainer
        from miles_engine.trainer.torch_trainer import TorchTrainer

        p = self.cfg.placement
        if p.trainer == "subprocess":
            trainer = FSDPTrainer(self.model, self.cfg.trainer, world_size=p.trainer_ranks)
        else:
            trainer = TorchTrainer(self.model, self.cfg.trainer)
        self._closers.append(lambda: asyncio.to_thread(trainer.close))
        return trainer

    async def _build_engine(self) -> Any:
        from miles_engine.engines.embedded import EmbeddedEngine

        e = self.cfg.engine
        model = self.model if isinstance(self.model, str) else copy.deepcopy(self.model)
        engine = await asyncio.to_thread(EmbeddedEngine.from_model, model, dtype=e.dtype, device=e.device,
                                         max_batch_size=e.max_batch_size, num_threads=e.threads,
                                         seed=self.cfg.seed, prompt_cache_tokens=e.prompt_cache_tokens)
        self._closers.insert(0, engine.aclose)
        if e.gil_switch_interval_ms is not None:
            previous = sys.getswitchinterval()
            sys.setswitchinterval(e.gil_switch_interval_ms / 1000)
            self._closers.append(lambda: _set_switch_interval(previous))
        return engine

    async def _start_server(self) -> Any:
        from miles_engine.tito.client import close_pools
        from miles_engine.tito.serve import start_session_server

        server = await start_session_server(self.engine, self.codec, config=self.cfg.session_server)
        self._closers[:0] = [close_pools, server.stop]
        return server

    def _transport_options(self) -> dict[str, Any]:
        w = self.cfg.weights
        if w.transport != "disk_delta":
            return {}
        return {**w.disk_delta.model_dump(), "root": w.disk_delta.root or str(self.run_dir / "weights")}

    def _make_agent(self) -> Any:
        options = {**self.cfg.agent.options, "server_url": self.server.url}
        return self.hub.create("agent", self.cfg.agent.name, options, where="agent.options")

    # ------------------------------------------------------------------ verbs the driver calls
    @property
    def version(self) -> int:
        return int(self.trainer.weight_version)

    def steps(self) -> range:
        return range(self.step + 1, self.cfg.run.steps + 1)

    def should_stop(self) -> bool:
        limit = self.cfg.run.max_minutes
        return self.stop_requested or (limit is not None and time.monotonic() - self.started > limit * 60)

    async def warm_start(self) -> None:
        from miles_engine.train.sft import run_sft

        if self.opd is not None:
            await self.opd.prepare()
        if self.cfg.sft.enabled and not self.resume:
            await run_sft(self)

    async def push_weights(self) -> int:
        t0 = time.perf_counter()
        tensors = await asyncio.to_thread(lambda: list(self.trainer.named_tensors()))
        crash_points.crash_point("weight_publish", self.current_step)
        stats = await self.transport.push(tensors, self.version)
        self.timers["push"] = time.perf_counter() - t0
        self.last_push = stats
        return stats.version

    async def next_groups(self, step: int) -> list[Group]:
        self.current_step = step
        crash_points.crash_point("generation", step)
        t0 = time.perf_counter()
        groups = await self.buffer.get(self.cfg.rollout.groups_per_step, self.version)
        if self.opd is not None:
            self.opd.check()  # a sample no teacher route covers stops the run
        self.timers["wait"] = time.perf_counter() - t0
        return groups

    async def train(self, step: int, groups: list[Group]) -> dict[str, float]:
        crash_points.crash_point("train_step", step)
        t0 = time.perf_counter()
        metrics = await asyncio.to_thread(self.trainer.train_step, groups)
        self.timers["train"] = time.perf_counter() - t0
        await asyncio.to_thread(consumed.append, self.run_dir, step, self.version, [g.group_id for g in groups])
        return metrics

    async def maybe_checkpoint(self, step: int, *, final: bool = False) -> None:
        """Every ``run.checkpoint_every`` steps (step 0 included: resumable from the first RL
        step) and at the end; never twice for one step."""
        every = self.cfg.run.checkpoint_every
        if self.saved_step == step or not (final or (every and step % every == 0)):
            return
        t0 = time.perf_counter()
        # taken now, on the event loop, so the buffer and the running groups are one consistent cut
        rollout = checkpoint.RolloutState(self.scheduler.next_position, self.buffer.snapshot(),
                                          self.scheduler.unfinished())
        rng = checkpoint.rng_states()
        state = await asyncio.to_thread(self.trainer.state_dict)
        t1 = time.perf_counter()
        info = resume.manifest_info(self.cfg.model_dump(mode="json"), self.tokenizer_sha, self.version, rollout)
        path = await asyncio.to_thread(checkpoint.save, self.run_dir, step=step, trainer_state=state, rollout=rollout,
                                       rng=rng, manifest=info, keep=self.cfg.run.checkpoint_keep)
        self.saved_step = step
        self.checkpoint_metrics.update({"checkpoint/write_s": time.perf_counter() - t0,
                                        "checkpoint/state_s": t1 - t0,
                                        "checkpoint/bytes": float(sum(f.stat().st_size for f in path.iterdir()))})

    def log(self, step: int, groups: list[Group], train_metrics: dict[str, float]) -> None:
        self.step = step
        metrics = {**group_metrics(groups),
                   **{k if k.startswith(_UNPREFIXED) else f"train/{k}": v for k, v in train_metrics.items()}}
        metrics.update(self.buffer.metrics(self.version))
        metrics.update(self.scheduler.metrics())
        metrics.update(self.mode.metrics())
        metrics.update(self.last_push.metrics())
        metrics.update(self.engine_metrics.metrics())
        metrics.update({f"time/{k}": v for k, v in self.timers.items()})
        metrics.update(self.checkpoint_metrics)
        self.checkpoint_metrics = {}
        metrics["time/elapsed"] = time.monotonic() - self.started
        self.metrics.log(step, metrics)
        self.samples.write(step, self.version, groups)

    async def aclose(self) -> None:
        for close in getattr(self, "mode", None) and [self.mode.stop] or []:
            await close()
        for close in self._closers:
            try:
                await close()
            except Exception as exc:  # teardown continues; the first error is reported by the caller
                print(f"warning: teardown step failed: {type(exc).__name__}: {exc}")
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()
