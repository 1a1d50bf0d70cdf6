"""Templates of ``miles new plugin --kind teacher`` (starts from the in-process ``local`` teacher)."""

from miles_engine.scaffold import readme

FILES = {
    "README.md": readme(),
    "PACKAGE/plugin.py": '''\
"""Registers the `$name` teacher: per-token log-probs of a local model (it never generates)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from miles_engine import hookimpl
from miles_engine.components import Component
from miles_engine.teachers.inprocess import LocalTeacher, LocalTeacherOptions


class ${cls}Options(BaseModel):
    """Options of `$name`; unknown keys are an error."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(description="model directory (weights + tokenizer.json)")
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16"] = "float32"
    temperature: float = Field(1.0, gt=0)


def make_teacher(options: ${cls}Options) -> LocalTeacher:
    # TODO: replace with your scorer (a served model, another runtime); keep the teacher protocol
    return LocalTeacher(LocalTeacherOptions(model=options.model, device=options.device, dtype=options.dtype,
                                            temperature=options.temperature), name="$name")


@hookimpl
def miles_register_teachers() -> list[Component]:
    return [Component("$name", make_teacher, options=${cls}Options, description="per-token teacher log-probs")]
''',
    "tests/test_contract.py": '''\
"""`$name` passes the teacher contract suite on a tiny random model built on the fly."""

from importlib import import_module
from typing import Any

import pytest

from miles_engine.hub import Hub, get_plugin_manager
from miles_engine.testing.teacher import TeacherContract

CORPUS = ["the quick brown fox jumps over the lazy dog", "print('hello world')", "1 + 1 = 2; 2 * 3 = 6"] * 20


@pytest.fixture(scope="session")
def tokenizer():
    from miles_engine.models.tokenizer import TitoTokenizer
    from miles_engine.models.bpe import BPE_ADDED_TOKENS
    from miles_engine.models.bpe import train_bpe

    return TitoTokenizer(train_bpe(CORPUS, vocab_size=320, added=BPE_ADDED_TOKENS["chatml"]), name="tiny")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, tokenizer):
    from miles_engine.models.tiny import TinyModelConfig, build_config, build_model

    cfg = build_config(TinyModelConfig(hidden_size=64, num_hidden_layers=1, intermediate_size=128, head_dim=16,
                                       max_position_embeddings=256), tokenizer.vocab_size,
                       bos_id=None, eos_id=None, pad_id=None)
    root = tmp_path_factory.mktemp("teacher")
    build_model(cfg, 1).save_pretrained(str(root))
    tokenizer.backend.save(str(root / "tokenizer.json"))
    return root


class Test${cls}Contract(TeacherContract):
    @pytest.fixture
    def generation_calls(self, monkeypatch):
        import transformers

        calls: list[Any] = []

        def refuse(*args, **kwargs):
            calls.append(args)
            raise AssertionError("a teacher must never generate")

        monkeypatch.setattr(transformers.GenerationMixin, "generate", refuse)
        return lambda: len(calls)

    @pytest.fixture
    def teacher(self, model_dir, generation_calls):
        pm = get_plugin_manager(load_entrypoints=False)
        pm.register(import_module("$package.plugin"), name="$package.plugin")
        return Hub(pm).create("teacher", "$name", {"model": str(model_dir)})

    @pytest.fixture
    def student_tokenizer(self, tokenizer):
        return tokenizer
''',
}
