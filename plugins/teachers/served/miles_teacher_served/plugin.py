"""Registers the ``served`` teacher."""

from __future__ import annotations

from miles_engine import hookimpl
from miles_engine.components import Component
from miles_teacher_served.options import ServedTeacherOptions
from miles_teacher_served.teacher import ServedTeacher


@hookimpl
def miles_register_teachers() -> list[Component]:
    return [Component("served", ServedTeacher, options=ServedTeacherOptions,
                      description="scores through an SGLang-compatible server's /generate (max_new_tokens=0)")]
