"""The ``served`` teacher: per-token teacher log-probs from SGLang's prefill-only ``/generate``
scoring call, against a real SGLang server or miles' own (``miles serve``)."""

from miles_teacher_served.options import ServedTeacherOptions
from miles_teacher_served.teacher import ServedTeacher

__all__ = ["ServedTeacher", "ServedTeacherOptions"]
