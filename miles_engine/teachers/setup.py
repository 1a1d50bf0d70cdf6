"""Wires the recipe's ``opd:`` section into a training stack: builds and checks the teachers,
trains the start-up teacher when asked, and provides the post-episode scoring step."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_engine.environments.capabilities import demonstrations
from miles_engine.errors import ConfigError
from miles_engine.models.tiny import build_config, build_model
from miles_engine.rollout.episodes import task_tags
from miles_engine.sft.loop import demo_rows, shuffled_batches, step_count, stopper
from miles_engine.teachers.compat import PROBE_TEXT, VocabFingerprint, fingerprint_tokenizer
from miles_engine.teachers.config import OPDRunConfig
from miles_engine.teachers.routing import TeacherRouter, TeacherRoutingError
from miles_engine.teachers.scoring import TeacherScoring, check_teachers

TEACHER_DIR = "teacher"
ROUTE_CHECK_TASKS = 64  # tasks whose tags are routed at start-up, so a missing route fails before training


@dataclass(frozen=True)
class OPDInputs:
    """What OPD uses from the run, and nothing else."""

    cfg: Any  # RecipeConfig: opd, trainer.opd, trainer.algorithm, seed
    hub: Any
    run_dir: Path
    codec: Any
    source: Any
    tasks: Any  # TaskStream: the first tasks' tags are routed at start-up
    metrics: Any
    student_models: Callable[[], list[Any]]  # in-process engine models (student top-k scoring)


class OPDSetup:
    def __init__(self, inputs: OPDInputs, cfg: OPDRunConfig) -> None:
        self.inputs, self.cfg = inputs, cfg
        self.teachers: dict[str, Any] = {}
        self.scoring: TeacherScoring | None = None
        self.fatal: BaseException | None = None

    @classmethod
    def build(cls, inputs: OPDInputs) -> OPDSetup | None:
        """Validate the ``opd:`` section against ``trainer.opd`` and build the ready teachers."""
        rcfg, topd = inputs.cfg.opd, inputs.cfg.trainer.opd
        if rcfg is None:
            if topd.enabled:
                raise ConfigError(f"trainer.opd (beta={topd.beta}, coef={topd.coef}) needs teachers: add an opd: "
                                  f"section with opd.teachers")
            return None
        if not topd.enabled:
            raise ConfigError("the recipe has an opd: section but trainer.opd.beta and trainer.opd.coef are 0: "
                              "set one of them (the teachers would score for nothing)")
        setup = cls(inputs, rcfg)
        trained = rcfg.train_teacher.teacher if rcfg.train_teacher else None
        if trained is not None:
            if trained not in rcfg.teachers:
                raise ConfigError(f"opd.train_teacher.teacher names '{trained}', which is not in opd.teachers "
                                  f"({', '.join(sorted(rcfg.teachers))})")
            if rcfg.teachers[trained].options.get("model") is not None:
                raise ConfigError(f"opd.teachers.{trained}.options.model is set but opd.train_teacher trains that "
                                  f"teacher: remove one of the two")
        names = TeacherRouter(dict.fromkeys(rcfg.teachers), route_tag=rcfg.route_tag, routes=rcfg.routes,
                              default=rcfg.default)  # config errors now, before anything is built
        for ref in inputs.tasks.refs[:ROUTE_CHECK_TASKS]:
            names.name_for(task_tags(inputs.source.load_task(ref.id)), sample=f"task {ref.id!r}")
        for name, ref in rcfg.teachers.items():
            if name != trained:
                setup.teachers[name] = setup._create(name, ref.name, ref.options)
        check_teachers(setup.teachers, setup.student_fingerprint())
        return setup

    def _create(self, name: str, kind: str, options: dict[str, Any]) -> Any:
        teacher = self.inputs.hub.create("teacher", kind, options, where=f"opd.teachers.{name}.options")
        teacher.name = name
        return teacher

    def student_fingerprint(self) -> VocabFingerprint:
        tok = self.inputs.codec.tokenizer
        return fingerprint_tokenizer(tok, PROBE_TEXT, sorted(tok.added_tokens))

    async def prepare(self, stop: Callable[[], bool] = lambda: False) -> None:
        """Train (or, on resume, reload) the start-up teacher; then build the scoring step."""
        inputs, spec = self.inputs, self.cfg.train_teacher
        if spec is not None:
            out = inputs.run_dir / TEACHER_DIR
            if not (out / "config.json").is_file():
                await asyncio.to_thread(train_teacher, inputs, spec, out, stop)
            ref = self.cfg.teachers[spec.teacher]
            options = {**ref.options, "model": str(out)}
            teacher = await asyncio.to_thread(self._create, spec.teacher, ref.name, options)
            check_teachers({spec.teacher: teacher}, self.student_fingerprint())
            self.teachers[spec.teacher] = teacher
        topd = inputs.cfg.trainer.opd
        mode = topd.candidates if topd.coef else "sampled"
        student = None
        if mode in ("student_topk", "intersection", "union"):
            from miles_engine.teachers.inprocess import ModelScorer

            models = inputs.student_models()
            if not models:
                raise ConfigError(f"trainer.opd.candidates={mode!r} scores the student's own top-k in the driver "
                                  f"process: it needs an engines group of kind 'embedded' (or candidates: sampled)")
            student = ModelScorer(models[0], temperature=inputs.cfg.trainer.algorithm.temperature)
        router = TeacherRouter(self.teachers, route_tag=self.cfg.route_tag, routes=self.cfg.routes,
                               default=self.cfg.default)
        self.scoring = TeacherScoring(router, mode=mode, top_k=topd.top_k, student=student)

    async def __call__(self, traj: Any) -> None:
        """The post-episode step; a routing error stops the run (raised by :meth:`check`)."""
        if self.scoring is None:
            raise RuntimeError("OPDSetup.prepare() was not awaited before the first episode")
        try:
            await self.scoring(traj)
        except TeacherRoutingError as exc:
            self.fatal = self.fatal or exc
            raise

    def check(self) -> None:
        if self.fatal is not None:
            raise self.fatal

    async def aclose(self) -> None:
        for teacher in self.teachers.values():
            await teacher.aclose()


def train_teacher(inputs: OPDInputs, spec: Any, out: Path, stop: Callable[[], bool] = lambda: False) -> None:
    """SFT a tiny model (the student's tokenizer) on fresh demonstrations; save it to ``out``."""
    from miles_engine.trainer.torch_trainer import TorchTrainer

    cfg, tok = inputs.cfg, inputs.codec.tokenizer
    config = build_config(spec.model, tok.vocab_size, bos_id=None, eos_id=inputs.codec.stop_ids[0],
                          pad_id=tok.added_tokens.get("<|endoftext|>", 0))
    model = build_model(config, cfg.seed + 101)
    demos = demonstrations(inputs.source, spec.demos, seed=cfg.seed + 103, wrong_fraction=spec.wrong_fraction)
    rows = demo_rows(inputs.codec, demos)
    steps = step_count(len(rows), epochs=spec.epochs, batch_size=spec.batch_size)
    trainer = TorchTrainer(model, {"optimizer": {"lr": spec.lr}, "num_threads": cfg.trainer.num_threads,
                                   "lr_schedule": {"kind": "linear", "warmup_steps": min(spec.warmup_steps, steps),
                                                   "total_steps": steps}})
    inputs.metrics.set_total(steps, kind="teacher")
    should_stop = stopper(stop, spec.max_minutes)
    for step, batch in shuffled_batches(len(rows), batch_size=spec.batch_size, steps=steps, seed=cfg.seed + 105):
        metrics = trainer.sft_step([rows[i] for i in batch])
        inputs.metrics.log(step, {f"teacher_sft/{k}": v for k, v in metrics.items()}, kind="teacher")
        if should_stop():
            break
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted run
    trainer.policy.save_pretrained(str(tmp))
    tok.backend.save(str(tmp / "tokenizer.json"))
    tmp.rename(out)  # a teacher directory on disk is always whole
