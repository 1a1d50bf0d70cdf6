"""Fixtures: a tiny teacher model directory, miles' HTTP server and a fake SGLang server over it,
each on 127.0.0.1 in a background thread (the contract suite runs its own event loops)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from served_testkit import ServerThread, fake_sglang_app, make_model_dir, tiny_tokenizer


@pytest.fixture(scope="session")
def student_tok():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory, student_tok) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("served-teacher"), seed=1, tokenizer=student_tok)


@pytest.fixture(scope="session")
def miles_server(teacher_dir: Path):
    """miles' SGLang-compatible server over the embedded engine; ``.generate_calls`` counts sampling."""
    from miles_engine.engines.embedded import load_engine
    from miles_engine.run.engine_server import create_engine_app

    engine = load_engine(str(teacher_dir))
    calls: list[object] = []
    original = engine.generate

    async def counted(request):  # type: ignore[no-untyped-def]
        calls.append(request)
        return await original(request)

    engine.generate = counted  # type: ignore[method-assign]
    with ServerThread(create_engine_app(engine, model_path=str(teacher_dir))) as server:
        server.generate_calls = calls
        yield server


@pytest.fixture(scope="session")
def sglang_server(teacher_dir: Path, student_tok):
    """A fake SGLang server (its /generate scoring, /get_model_info, /v1/tokenize, --api-key)."""
    app = fake_sglang_app(teacher_dir, student_tok, api_key="sk-test")
    with ServerThread(app) as server:
        server.app = app
        yield server
