"""The recipe's ``opd:`` section: which teachers score which samples, and an optional teacher
trained at start-up (a tiny model SFT-ed on the environment's demonstrations)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from miles_engine.components import Section
from miles_engine.models.tiny import TinyModelConfig


class TeacherRef(Section):
    name: str = Field(description="a registered teacher (miles plugins) or a dotted import path")
    options: dict[str, Any] = Field(default_factory=dict)


class TeacherTrainingConfig(Section):
    """Build a tiny teacher from ``model`` with the student's tokenizer and SFT it on fresh
    demonstrations before RL; saved under ``<run dir>/teacher`` and reused on ``--resume``."""

    teacher: str = Field(description="the opd.teachers entry that scores with the trained model "
                         "(its options.model must be unset)")
    model: TinyModelConfig = Field(default_factory=TinyModelConfig)
    demos: int = Field(2000, ge=1)
    batch_size: int = Field(32, ge=1)
    epochs: float = Field(1.0, gt=0)
    lr: float = Field(5e-3, gt=0)
    warmup_steps: int = Field(10, ge=0)
    wrong_fraction: float | None = Field(0.0, ge=0, le=1, description="share of wrong demonstrations "
                                         "(default 0: the teacher learns from correct ones only)")
    max_minutes: float | None = Field(None, gt=0)


class OPDRunConfig(Section):
    teachers: dict[str, TeacherRef] = Field(description="teachers by the name routes refer to")
    route_tag: str | None = Field(None, description="the trajectory tag routes match (e.g. kind)")
    routes: dict[str, str] = Field(default_factory=dict, description="tag value -> teacher name")
    default: str | None = Field(None, description="teacher for samples no route matches")
    train_teacher: TeacherTrainingConfig | None = None
