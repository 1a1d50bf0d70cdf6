from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import make_model_dir, tiny_tokenizer


@pytest.fixture(scope="session")
def student_tok():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory, student_tok) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("teacher"), hidden=64, seed=1, tokenizer=student_tok)
