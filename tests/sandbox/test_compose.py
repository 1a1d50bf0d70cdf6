"""Compose services as sidecar specs (miles_engine.sandbox.compose)."""

from __future__ import annotations

import pytest

from miles_engine.errors import TaskFormatError
from miles_engine.sandbox.compose import argv, fill, load_sidecars

COMPOSE = """\
services:
  main:
    depends_on: [db]
  db:
    image: ${DB_IMAGE:-postgres:16}
    environment: {POSTGRES_PASSWORD: "$${literal}", USER: "${DB_USER}"}
    command: "postgres -c fsync=off"
    healthcheck:
      test: ["CMD-SHELL", "pg_isready -U postgres"]
  web:
    build: {context: web, dockerfile: Dockerfile.web}
    command: ["python3", "-m", "http.server"]
    healthcheck: {test: ["NONE"]}
"""


def test_sidecars_from_an_overlay(tmp_path):
    (tmp_path / "web").mkdir()
    path = tmp_path / "docker-compose.yaml"
    path.write_text(COMPOSE)
    db, web = load_sidecars(path, main="main", variables={"DB_USER": "ada"})
    assert (db.name, db.image, dict(db.env)) == ("db", "postgres:16", {"POSTGRES_PASSWORD": "${literal}", "USER": "ada"})
    assert db.command == ("/bin/sh", "-c", "postgres -c fsync=off")
    assert db.healthcheck == ("/bin/sh", "-c", "pg_isready -U postgres")
    assert web.build is not None and web.build.context_dir == (tmp_path / "web").resolve()
    assert web.build.dockerfile == "Dockerfile.web" and web.image is None and web.healthcheck is None
    assert web.command == ("python3", "-m", "http.server")
    with pytest.raises(TaskFormatError, match=r"services\.db\.environment\.USER: variable \$\{DB_USER\} is not set"):
        load_sidecars(path, main="main")
    assert dict(load_sidecars(path, main="main", strict=False)[0].env)["USER"] == ""


def test_fill_and_argv_forms():
    assert fill("a-$X-${Y:-d}-$$Z", {"X": "1"}, "w") == "a-1-d-$Z"
    assert argv(["CMD", "true"], {}, "w") == ("true",)
    with pytest.raises(TaskFormatError, match="w: must be a string or a non-empty list"):
        argv([], {}, "w")
