"""Built-in plugin registering the in-process ``local`` teacher.

It is core rather than a ``plugins/teachers/`` distribution because the core reuses its
scorer for the student's own top-K candidate sets and for the teacher the OPD recipe trains
at start-up; it registers through the same hook as third-party teachers.
"""

from __future__ import annotations

from miles_engine import hookimpl
from miles_engine.components import Component
from miles_engine.teachers.inprocess import LocalTeacherOptions, make_local_teacher


@hookimpl
def miles_register_teachers() -> list[Component]:
    return [Component("local", make_local_teacher, options=LocalTeacherOptions,
                      description="in-process teacher: a local model directory or config (transformers, CPU/GPU)")]
