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


ORDERED = """\
services:
  main:
    depends_on: {api: {condition: service_healthy}}
    volumes: ["shared:/shared", "${LOGS:-/host/logs}:/logs"]
  init:
    image: ubuntu:24.04
    volumes: ["shared:/data", "./seed:/seed:ro", {type: volume, target: /scratch}]
  api:
    image: ubuntu:24.04
    depends_on:
      init: {condition: service_completed_successfully}
    volumes: [{type: volume, source: shared, target: /data, read_only: true}]
    healthcheck: {test: ["CMD", "true"]}
"""


def test_depends_on_and_volumes(tmp_path):
    from miles_engine.sandbox.compose import load_services, start_order
    from miles_engine.sandbox.protocol import VolumeMount

    (tmp_path / "seed").mkdir()
    path = tmp_path / "docker-compose.yaml"
    path.write_text(ORDERED)
    loaded = load_services(path, main="main")
    init, api = loaded.sidecars
    assert loaded.main_volumes == (VolumeMount(source="shared", target="/shared"),)  # the host log bind is left out
    assert init.volumes == (VolumeMount(source="shared", target="/data"),
                            VolumeMount(source=str((tmp_path / "seed").resolve()), target="/seed", read_only=True),
                            VolumeMount(source="", target="/scratch"))
    assert api.volumes == (VolumeMount(source="shared", target="/data", read_only=True),)
    assert dict(api.depends_on) == {"init": "service_completed_successfully"} and init.depends_on == {}
    assert (api.main_waits_for, init.main_waits_for) == ("service_healthy", None)
    assert [s.name for s in start_order((api, init), where="w")] == ["init", "api"]


@pytest.mark.parametrize("change, error", [
    (("  api:\n    image: ubuntu:24.04\n    depends_on:\n      init: {condition: service_completed_successfully}",
      "  api:\n    image: ubuntu:24.04\n    depends_on: [nope]"), r"services\.api\.depends_on: no service 'nope'"),
    (("init: {condition: service_completed_successfully}", "init: {condition: done}"),
     r"services\.api\.depends_on\.init\.condition: 'done' is not one of service_started"),
    (("    image: ubuntu:24.04\n    volumes: [\"shared", "    image: ubuntu:24.04\n    depends_on: [api]\n    volumes: [\"shared"),
     r"depends_on cycle (init -> api -> init|api -> init -> api)"),
    (("./seed:/seed:ro", "/var/run/docker.sock:/sock"),
     r"services\.init\.volumes\[1\]: bind of '/var/run/docker.sock' is outside the task's directory"),
    (("./seed:/seed:ro", "../..:/up"), r"bind of '\.\./\.\.' is outside the task's directory"),
    (("./seed:/seed:ro", "./missing:/m"), r"bind source '.*missing' does not exist"),
    (('healthcheck: {test: ["CMD", "true"]}', "command: [sleep, '1']"),
     r"depends on 'api' being service_healthy but 'api' has no healthcheck"),
    (("shared:/shared", "shared:relative"), r"services\.main\.volumes\[0\]: target 'relative' must be an absolute"),
])
def test_compose_order_and_volume_errors(tmp_path, change, error):
    from miles_engine.sandbox.compose import load_services

    (tmp_path / "seed").mkdir()
    path = tmp_path / "docker-compose.yaml"
    old, new = change
    assert old in ORDERED
    path.write_text(ORDERED.replace(old, new))
    with pytest.raises(TaskFormatError, match=error):
        load_services(path, main="main")
