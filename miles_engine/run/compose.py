"""The composition root: a recipe becomes a frozen set of components, torn down in reverse.

    async with compose(cfg, run_dir, hub=hub) as parts:
        run = TrainingRun(parts)
        await drive(run)

Every topology is decided here once, from the recipe: the engine groups (``engines``) behind
the router, the weight transport that reaches them, where the trainer runs, the rollout mode.
Each consumer (SFT warm start, OPD, the driver's run) is handed only what it uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from miles_engine import checkpoint
from miles_engine.checkpoint import crash_points, resume
from miles_engine.checkpoint.compat import check as check_resume
from miles_engine.config.recipe import RecipeConfig
from miles_engine.engines.fleet.build import check_on_update, check_transport, create_kinds, start_fleet
from miles_engine.engines.fleet.kinds import EngineKind, FleetContext
from miles_engine.environments.admission import admit_on
from miles_engine.errors import ConfigError
from miles_engine.evaluation.evaluator import EvalInputs, Evaluator, build_evaluator
from miles_engine.evaluation.splits import resume_split_change, train_filter
from miles_engine.hub import Hub
from miles_engine.metrics import MetricsLogger
from miles_engine.metrics.samples import SampleLog
from miles_engine.metrics.trajectory_recorder import TrajectoryRecorder
from miles_engine.rollout.buffer import AsyncBuffer
from miles_engine.rollout.episodes import EpisodeTrajectories
from miles_engine.rollout.modes import RolloutMode, create_mode, validate_mode
from miles_engine.rollout.parts import agent_factory, open_environment, open_reward, open_sandboxes
from miles_engine.rollout.scheduler import Scheduler
from miles_engine.rollout.tasks import TaskStream
from miles_engine.run.policy import build_codec, build_policy
from miles_engine.run.trainer_access import TrainerAccess
from miles_engine.sandbox.remote import RUN_ID_ENV
from miles_engine.sft.dataset_run import resumes_sft
from miles_engine.teachers.setup import OPDInputs, OPDSetup
from miles_engine.tito.client import close_pools
from miles_engine.tito.families.base import ChatCodec
from miles_engine.tito.serve import BackgroundServer, start_session_server
from miles_engine.trainer.draft import DraftTrainer, draft_to_train
from miles_engine.trainer.megatron.dist_checkpoint import check_backend
from miles_engine.weights import create_transport
from miles_engine.weights.disk_delta.baseline import write_baseline
from miles_engine.weights.protocol import WeightTransport

if TYPE_CHECKING:
    from miles_engine.cluster.placement import RayPlacement
    from miles_engine.engines.router import Router
    from miles_engine.environments.protocol import EnvironmentSource
    from miles_engine.sandbox.protocol import SandboxBackend


@dataclass(frozen=True)
class Components:
    """What a training run is made of; built once by :func:`compose`, never rebuilt."""

    cfg: RecipeConfig
    run_dir: Path
    hub: Hub
    source: EnvironmentSource
    tasks: TaskStream
    codec: ChatCodec
    tokenizer_sha: str
    trainer: TrainerAccess
    engines: Router  # over every engine group
    server: BackgroundServer  # the TITO session server in front of the router
    transport: WeightTransport
    buffer: AsyncBuffer
    scheduler: Scheduler
    mode: RolloutMode
    opd: OPDSetup | None
    metrics: MetricsLogger
    samples: SampleLog
    resumed: checkpoint.Loaded | None
    policy: Any  # the model (or model reference) the trainer and engines started from
    evaluator: Evaluator  # after_step(step, version) (a no-op one without eval.every)
    progress: RunProgress
    placement: RayPlacement | None = None  # under placement.backend=ray
    sandboxes: SandboxBackend | None = None  # its optional step_metrics() feeds sandbox/* per step
    resume_sft: bool = False  # --resume of a run stopped during its sft.dataset warm start
    trajectories: TrajectoryRecorder | None = None  # RUN_DIR/trajectories.mtr (metrics.trajectories)
    draft: DraftTrainer | None = None  # the co-trained speculative draft (engines.N.options.speculative.train)


@dataclass
class RunProgress:
    """The step the run is at, for components that report lag (the evaluator)."""

    step: int = 0


class Teardown(AsyncExitStack):
    """Tears down in reverse order; a failing step is reported and the rest still run, so a
    teardown error never masks the error that ended the run."""

    def push_async_callback(self, callback: Any, /, *args: Any, **kwds: Any) -> Any:
        async def guarded() -> None:
            try:
                await callback(*args, **kwds)
            except Exception as exc:  # noqa: BLE001 - reported, teardown continues
                print(f"warning: teardown step {getattr(callback, '__qualname__', callback)} failed: "
                      f"{type(exc).__name__}: {exc}")

        return super().push_async_callback(guarded)

    def callback(self, callback: Any, /, *args: Any, **kwds: Any) -> Any:
        async def run() -> None:
            callback(*args, **kwds)

        return self.push_async_callback(run)


def embedded_models(engines: Router) -> list[Any]:
    """The in-process engines' models (OPD's student top-k scorer needs one)."""
    return [s.engine.model for s in engines.slots if hasattr(s.engine, "model")]


@contextlib.asynccontextmanager
async def compose(cfg: RecipeConfig, run_dir: Path, *, hub: Hub, resume_run: bool = False) -> AsyncIterator[Components]:
    async with Teardown() as stack:
        yield await _build(cfg, run_dir, hub, resume_run, stack)


async def _build(cfg: RecipeConfig, run_dir: Path, hub: Hub, resume_run: bool, stack: AsyncExitStack) -> Components:
    crash_points.check_env()
    resume_sft = resume_run and resumes_sft(run_dir)  # stopped mid-SFT: no RL checkpoint yet
    # read and check the checkpoint first: a bad one fails before anything starts
    resumed = await _load_checkpoint(cfg, run_dir) if resume_run and not resume_sft else None
    _check_topology(cfg)
    buffer = AsyncBuffer(cfg.buffer, on_reward_error=cfg.reward.on_error)
    validate_mode(cfg.rollout.mode, colocated=cfg.placement.colocated, groups_per_step=cfg.rollout.groups_per_step,
                  buffer=buffer)
    metrics = MetricsLogger(run_dir, cfg.metrics, total_steps=cfg.run.steps, run_config=cfg.model_dump(mode="json"))
    stack.callback(metrics.close)
    source = open_environment(hub, cfg.environment, stack)
    # remote sandboxes carry the run name as their `miles.run` label: `miles sandbox sweep --run NAME`
    os.environ.setdefault(RUN_ID_ENV, run_dir.name)
    sandboxes = open_sandboxes(hub, cfg.sandbox, stack)
    tasks = _runnable_tasks(cfg, source, sandboxes, metrics)
    codec = build_codec(cfg, hub, source)
    tokenizer_sha = resume.tokenizer_sha256(codec.tokenizer)
    if resumed is not None:
        check_resume(resumed.manifest, cfg.model_dump(mode="json"), tokenizer_sha, resumed.path,
                     rules=[resume_split_change])
    policy = build_policy(cfg, codec)
    kinds = _engine_kinds(cfg, hub)
    placement = await _start_placement(cfg, kinds, run_dir, stack)
    trainer = await asyncio.to_thread(TrainerAccess.create, policy, cfg,
                                      ranks=None if placement is None else placement.trainer_ranks(), run_dir=run_dir)
    stack.push_async_callback(asyncio.to_thread, trainer.close)
    draft = await asyncio.to_thread(draft_to_train, cfg, kinds, seed=cfg.seed, vocab_size=codec.tokenizer.vocab_size)
    engines = await _start_engines(cfg, kinds, run_dir, policy, trainer, placement, stack)
    server = await _start_server(cfg, run_dir, engines, codec, placement, stack)
    transport = await _start_transport(cfg, run_dir, engines, kinds, trainer, resumed, placement, stack, draft=draft)
    opd = _build_opd(cfg, hub, run_dir, codec, source, tasks, metrics, engines, stack)
    reward = open_reward(hub, cfg.reward, stack)
    run_trajectory = await _episode_runner(cfg, hub, sandboxes, source, server, reward, opd, placement, stack,
                                           engines=engines, codec=codec)
    scheduler, mode = _build_rollout(cfg, run_dir, tasks, run_trajectory, buffer, engines, resumed, stack)
    samples = SampleLog(run_dir, cfg.metrics.samples_per_step, codec.tokenizer.decode)
    stack.push_async_callback(asyncio.to_thread, samples.close)
    recorder = TrajectoryRecorder(run_dir, cfg.metrics.trajectories, seed=cfg.seed, decode=codec.tokenizer.decode)
    stack.push_async_callback(asyncio.to_thread, recorder.close)
    buffer.on_drop = recorder.dropped
    progress = RunProgress()
    evaluator = await build_evaluator(EvalInputs(
        cfg=cfg, run_dir=run_dir, hub=hub, source=source, tasks=tasks, backend=sandboxes, reward=reward,
        metrics=metrics, scheduler=scheduler, server=server, model=policy, codec=codec, trainer=trainer,
        progress=progress))
    stack.push_async_callback(evaluator.aclose)  # drains queued evals before the engines stop
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return Components(cfg=cfg, run_dir=run_dir, hub=hub, source=source, tasks=tasks, codec=codec,
                      tokenizer_sha=tokenizer_sha, trainer=trainer, engines=engines, server=server,
                      transport=transport, buffer=buffer, scheduler=scheduler, mode=mode, opd=opd, metrics=metrics,
                      samples=samples, resumed=resumed, policy=policy, evaluator=evaluator, progress=progress,
                      placement=placement, resume_sft=resume_sft, sandboxes=sandboxes, trajectories=recorder,
                      draft=draft)


async def _load_checkpoint(cfg: RecipeConfig, run_dir: Path) -> checkpoint.Loaded:
    t0 = time.perf_counter()
    resumed = await asyncio.to_thread(checkpoint.load_latest, run_dir)
    resumed.load_s = time.perf_counter() - t0
    check_backend(resumed.trainer_state, cfg.trainer.backend, resumed.path)
    return resumed


def _check_topology(cfg: RecipeConfig) -> None:
    cfg.trainer.check_group_size(cfg.rollout.group_size, "rollout.group_size")
    if cfg.placement.colocated and cfg.trainer.parallel.world_size > 1:
        raise ConfigError(f"placement.trainer=in_process runs one trainer in the driver process, but "
                          f"trainer.parallel.world_size is {cfg.trainer.parallel.world_size}; use "
                          f"placement.trainer=subprocess for FSDP2 ranks (or world_size 1)")


def _runnable_tasks(cfg: RecipeConfig, source: EnvironmentSource, sandboxes: SandboxBackend,
                    metrics: MetricsLogger) -> TaskStream:
    """The training task stream over the tasks the sandbox backend can run. Each task it cannot
    (or that its reader does not support) is left out with its own reason, said here at start-up
    and logged (``environment/tasks_excluded``); the run refuses only when nothing is left."""
    keep = train_filter(cfg.eval, source)
    listed = TaskStream(source, seed=cfg.rollout.task_seed, task_filter=keep)
    admission = admit_on(source, cfg.sandbox.backend, sandboxes, task_ids=[r.id for r in listed.refs])
    print(admission.report(), flush=True)
    metrics.log(0, admission.metrics(), kind="environment")
    admission.require_some("to train on")
    if not admission.excluded:
        return listed
    excluded = admission.excluded_ids
    return TaskStream(source, seed=cfg.rollout.task_seed,
                      task_filter=lambda ref: ref.id not in excluded and (keep is None or keep(ref)))


def _engine_kinds(cfg: RecipeConfig, hub: Hub) -> list[EngineKind]:
    kinds = create_kinds(hub, cfg.engines)
    check_transport(cfg.weights.transport, cfg.engines, kinds)
    check_on_update(cfg.rollout.on_update, cfg.engines, kinds)
    return kinds


async def _start_placement(cfg: RecipeConfig, kinds: list[EngineKind], run_dir: Path,
                           stack: AsyncExitStack) -> RayPlacement | None:
    """placement.backend=ray: join the cluster and reserve every actor's resources, before anything starts."""
    if cfg.placement.backend != "ray":
        return None
    from miles_engine.cluster.placement import RayPlacement  # ray

    return await RayPlacement.start(cfg, kinds, stack, run_name=run_dir.name)


async def _start_engines(cfg: RecipeConfig, kinds: list[EngineKind], run_dir: Path, policy: Any,
                         trainer: TrainerAccess, placement: RayPlacement | None, stack: AsyncExitStack) -> Router:
    ctx = FleetContext(model=policy, state_dir=run_dir / "engines", seed=cfg.seed, restore=trainer.last_pushed,
                       true_on_policy=cfg.trainer.true_on_policy, launcher=placement,
                       weight_format=cfg.precision.rollout, weight_exceptions=tuple(cfg.precision.exceptions),
                       kv_cache=cfg.precision.kv_cache)
    return await start_fleet(cfg.engines, kinds, ctx, stack, cfg.fleet)


async def _start_server(cfg: RecipeConfig, run_dir: Path, engines: Router, codec: ChatCodec,
                        placement: RayPlacement | None, stack: AsyncExitStack) -> BackgroundServer:
    s = cfg.session_server
    host = s.host
    if placement is not None and "host" not in s.model_fields_set:
        # under Ray the episode runners reach it from their nodes: the driver node's address (loopback on a private cluster)
        host = placement.driver_address()
    server = await start_session_server(engines, codec, host=host, port=s.port, config=s)
    stack.push_async_callback(server.stop)
    stack.push_async_callback(close_pools)
    # harnesses in other processes or sandboxes find the run's session server here (POST /sessions)
    url_file = run_dir / "session_server.url"
    url_file.write_text(server.url + "\n")
    stack.callback(url_file.unlink, missing_ok=True)
    print(f"session server: {server.url} (POST /sessions; also in {url_file})", flush=True)
    return server


async def _start_transport(cfg: RecipeConfig, run_dir: Path, engines: Router, kinds: list[EngineKind],
                           trainer: TrainerAccess, resumed: checkpoint.Loaded | None, placement: RayPlacement | None,
                           stack: AsyncExitStack, *, draft: DraftTrainer | None = None) -> WeightTransport:
    w = cfg.weights
    options: dict[str, Any] = {}
    if w.transport == "broadcast" and placement is not None:  # rank 0: trainer rank 0's actor, else this node
        # a co-trained draft is trained here: the push must pass through this process to carry it
        # adapters (trainer.lora.push) are small: they pass through this process like the draft
        sender = trainer.use_rank0_sender() if draft is None and cfg.trainer.lora.push == "merged" else None
        options.update({"sender": sender} if sender is not None else {"master_address": placement.driver_address()})
    if w.transport == "p2p":  # the trainer ranks write to the engines; the driver keeps the control plane
        if draft is not None:
            raise ConfigError("engines.N.options.speculative.train with weights.transport=p2p: the co-trained draft "
                              "lives in this process, not on the trainer ranks; use weights.transport=broadcast")
        options = {"sources": trainer.p2p_sources(), "bucket_bytes": int(w.p2p.bucket_mb * 2**20),
                   "backend": w.p2p.backend, "timeout_s": w.p2p.timeout_s,
                   "master_address": placement.driver_address() if placement is not None else "127.0.0.1"}
    if w.transport == "disk_delta":
        options = {**w.disk_delta.model_dump(), "root": w.disk_delta.root or str(run_dir / "weights")}
        if options["baseline"] is None and not any(kind.in_process for kind in kinds):
            if draft is not None:
                raise ConfigError("engines.N.options.speculative.train with weights.transport=disk_delta needs the "
                                  "engines in this process (kind embedded): out-of-process engines start their "
                                  "draft from its source, not from a baseline the trainer wrote; use "
                                  "weights.transport=broadcast")
            # the engine processes started from the policy's weights: version 0 is exactly what the trainer exports
            options["baseline"] = await asyncio.to_thread(write_baseline, await trainer.named_tensors(),
                                                          run_dir / "engines" / "baseline.safetensors")
    options["pause_mode"] = cfg.rollout.on_update
    transport = create_transport(w.transport, engines, check=w.check, **options)
    stack.push_async_callback(transport.close)
    if resumed is not None:  # disk_delta: drop the abandoned future
        await transport.rewind(int(resumed.manifest["weight_version"]))
    # disk_delta: what the trainer exports must match its baseline, before training
    exported = await trainer.export_for_push()
    await transport.preflight(draft.with_policy(exported) if draft is not None else exported)
    return transport


def _build_opd(cfg: RecipeConfig, hub: Hub, run_dir: Path, codec: ChatCodec, source: EnvironmentSource,
               tasks: TaskStream, metrics: MetricsLogger, engines: Router, stack: AsyncExitStack) -> OPDSetup | None:
    inputs = OPDInputs(cfg=cfg, hub=hub, run_dir=run_dir, codec=codec, source=source, tasks=tasks, metrics=metrics,
                       student_models=lambda: embedded_models(engines))
    opd = OPDSetup.build(inputs)
    if opd is not None:
        stack.push_async_callback(opd.aclose)
    return opd


async def _episode_runner(cfg: RecipeConfig, hub: Hub, sandboxes: SandboxBackend, source: EnvironmentSource,
                          server: BackgroundServer, reward: Any, opd: OPDSetup | None, placement: RayPlacement | None,
                          stack: AsyncExitStack, engines: Router, codec: ChatCodec) -> Any:
    """The scheduler's ``run_trajectory``: episodes in this process, or in runner actors under Ray."""
    if placement is not None:
        from miles_engine.cluster.episode_runners import RunnerSpec  # ray

        spec = RunnerSpec(cfg.environment, cfg.sandbox, cfg.agent, cfg.reward, server.url,
                          env=((RUN_ID_ENV, os.environ[RUN_ID_ENV]),))
        servers = await placement.session_servers(engines, codec, cfg.session_server)  # None: the driver's
        if servers is not None:
            stack.push_async_callback(servers.close)
        runners = await placement.episode_runners(spec, after=opd, servers=servers)
        stack.push_async_callback(runners.close)
        return runners
    make_agent = agent_factory(hub, cfg.agent, server_url=server.url)
    return EpisodeTrajectories(sandboxes, make_agent, source, reward, after=opd)


def _build_rollout(cfg: RecipeConfig, run_dir: Path, tasks: TaskStream, run: Any, buffer: AsyncBuffer,
                   engines: Router, resumed: checkpoint.Loaded | None,
                   stack: AsyncExitStack) -> tuple[Scheduler, RolloutMode]:
    rollout = resumed.rollout if resumed is not None else checkpoint.RolloutState(cursor=0)
    scheduler = Scheduler(tasks.iter_from(rollout.cursor), run, buffer, cfg.rollout,
                          version_fn=lambda: engines.weight_version, first_position=rollout.cursor,
                          requeue=resume.requeued_refs(tasks, rollout, run_dir))
    mode = create_mode(cfg.rollout.mode, scheduler, groups_per_step=cfg.rollout.groups_per_step)
    stack.push_async_callback(mode.stop)
    return scheduler, mode
