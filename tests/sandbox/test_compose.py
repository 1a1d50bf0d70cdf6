"""Compose services as sidecar specs (miles_engine.sandbox.compose)."""

from __future__ import annotations

import re

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


LIMITED = """\
services:
  main:
    cpus: 1.5
    mem_limit: 1g
    ports: ["8080:80"]
  db:
    image: postgres:16
    cpus: "0.5"
    mem_limit: 256m
    pids_limit: 64
    ports: ["127.0.0.1:5432:5432/tcp", {target: 5433, published: 15433}]
    expose: ["9000", 9001]
  cache:
    image: redis:7
    deploy: {resources: {limits: {cpus: '0.25', memory: 50M, pids: 32}, reservations: {memory: 10M}}}
  plain:
    image: busybox
"""


def test_limits_and_ports(tmp_path, caplog):
    from miles_engine.sandbox.compose import load_services
    from miles_engine.sandbox.protocol import Resources

    path = tmp_path / "docker-compose.yaml"
    path.write_text(LIMITED)
    with caplog.at_level("INFO", logger="miles_engine.sandbox.compose_limits"):
        loaded = load_services(path, main="main")
    db, cache, plain = loaded.sidecars
    assert (db.resources, db.pids_limit) == (Resources(cpus=0.5, memory_mb=256), 64)
    assert (cache.resources, cache.pids_limit) == (Resources(cpus=0.25, memory_mb=50), 32)
    assert (plain.resources, plain.pids_limit) == (Resources(), None)
    assert loaded.main_limits.resources == Resources(cpus=1.5, memory_mb=1024)
    said = caplog.text
    assert "services.db: ports 5432, 5433 not published on the host" in said and "(db:5432, db:5433)" in said
    assert "services.main: ports 80 not published on the host" in said


@pytest.mark.parametrize("change, error", [
    (('cpus: "0.5"', "cpus: lots"), r"services\.db\.cpus: 'lots' is not a positive number of CPUs"),
    (('cpus: "0.5"', "cpus: 0"), r"services\.db\.cpus: 0 is not a positive number"),
    (("mem_limit: 256m", "mem_limit: 256 parsecs"), r"services\.db\.mem_limit: '256 parsecs' is not a size"),
    (("mem_limit: 256m", "mem_limit: 1k"), r"services\.db\.mem_limit: '1k' is below the engine's minimum"),
    (("pids_limit: 64", "pids_limit: many"), r"services\.db\.pids_limit: 'many' is not a whole number"),
    (("memory: 50M", "memory: 1x"), r"services\.cache\.deploy\.resources\.limits\.memory: '1x' is not a size"),
    (('pids_limit: 64', "pids_limit: 64\n    deploy: {resources: {limits: {pids: 65}}}"),
     r"services\.db: 'pids_limit' \(64\) and 'deploy\.resources\.limits\.pids' \(65\) differ"),
    (("deploy: {resources: {limits:", "deploy: {resources: {limits: 2, x:"),
     r"services\.cache\.deploy\.resources\.limits: must be a mapping"),
    (('"127.0.0.1:5432:5432/tcp"', '"5432:huh"'),
     r"services\.db\.ports\[0\]: '5432:huh' is not \[\[HOST_IP:\]HOST_PORT:\]CONTAINER_PORT\[/PROTOCOL\]"),
    (('"127.0.0.1:5432:5432/tcp"', '"99999"'), r"services\.db\.ports\[0\]: port 99999 is out of range"),
    (("target: 5433", "target: web"), r"services\.db\.ports\[1\]\.target: 'web' is not a container port"),
    (('expose: ["9000", 9001]', "expose: 9000"), r"services\.db\.expose: must be a list"),
    (('expose: ["9000", 9001]', 'expose: ["9000:9000"]'), r"services\.db\.expose\[0\]: '9000:9000' is not PORT"),
])
def test_limit_and_port_errors_name_service_key_and_file(tmp_path, change, error):
    from miles_engine.sandbox.compose import load_services

    path = tmp_path / "docker-compose.yaml"
    old, new = change
    assert old in LIMITED
    path.write_text(LIMITED.replace(old, new, 1))
    with pytest.raises(TaskFormatError, match=re.escape(str(path)) + " " + error):
        load_services(path, main="main")


def test_service_limits_over_the_backend_maximum_are_refused():
    from miles_engine.errors import SandboxUnsupportedError
    from miles_engine.sandbox.protocol import Capabilities, Resources, SandboxSpec, ServiceSpec, check_supported

    spec = SandboxSpec(services=(ServiceSpec(name="db", image="x", resources=Resources(cpus=8, memory_mb=4096)),))
    caps = Capabilities(isolation="container", images=True, absolute_paths=True, services=True, max_cpus=4,
                        max_memory_mb=2048)
    with pytest.raises(SandboxUnsupportedError, match=r"8.0 CPUs for service 'db' \(max 4.0\); "
                                                       r"4096 MB memory for service 'db' \(max 2048\)"):
        check_supported(spec, caps, backend="docker")


def test_the_agent_services_environment_is_carried_filled(tmp_path):
    from miles_engine.errors import TaskFormatError
    from miles_engine.sandbox.compose import load_services

    path = tmp_path / "docker-compose.yaml"
    path.write_text("services:\n  main:\n    environment:\n      - DB_URL=postgres://db:${DB_PORT:-5432}/app\n"
                    "      - MODE=test\n  db:\n    image: postgres\n")
    assert load_services(path, main="main").main_env == {"DB_URL": "postgres://db:5432/app", "MODE": "test"}
    path.write_text("services:\n  main:\n    environment: 7\n")
    with pytest.raises(TaskFormatError, match=r"services\.main\.environment: must be a list of KEY=VALUE"):
        load_services(path, main="main")
