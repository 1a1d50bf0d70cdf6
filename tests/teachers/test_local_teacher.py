"""The built-in ``local`` teacher passes the teacher contract suite; option errors are clear."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from miles_engine.errors import ConfigError
from miles_engine.hub import Hub
from miles_engine.teachers.inprocess import LocalTeacher, LocalTeacherOptions
from miles_engine.testing.teacher import TeacherContract

pytestmark = pytest.mark.timeout(120)


class TestLocalTeacherContract(TeacherContract):
    @pytest.fixture
    def generation_calls(self, monkeypatch: pytest.MonkeyPatch):
        import transformers

        calls: list[Any] = []

        def refuse(*args: Any, **kwargs: Any) -> Any:
            calls.append(args)
            raise AssertionError("a teacher must never generate")

        monkeypatch.setattr(transformers.GenerationMixin, "generate", refuse)
        return lambda: len(calls)

    @pytest.fixture
    def teacher(self, teacher_dir: Path, generation_calls) -> LocalTeacher:
        return Hub().create("teacher", "local", {"model": str(teacher_dir)})

    @pytest.fixture
    def student_tokenizer(self, student_tok):
        return student_tok


def test_registered_as_a_builtin() -> None:
    reg = Hub().get("teacher", "local")
    assert reg.builtin and reg.component.options is LocalTeacherOptions


def test_config_model_needs_a_tokenizer() -> None:
    with pytest.raises(ConfigError, match="options.tokenizer is required when options.model is a config"):
        LocalTeacher(LocalTeacherOptions(model={"model_type": "qwen3", "vocab_size": 300}))
    with pytest.raises(ConfigError, match="options.model is required"):
        LocalTeacher(LocalTeacherOptions())


def test_unknown_option_is_refused() -> None:
    with pytest.raises(ConfigError, match="modle"):
        Hub().create("teacher", "local", {"modle": "x"})


def test_missing_model_dir_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=str(tmp_path / "nope")):
        LocalTeacher(LocalTeacherOptions(model=str(tmp_path / "nope")))
