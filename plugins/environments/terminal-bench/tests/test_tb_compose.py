"""A docker-compose.yaml's client service becomes the task's sandbox spec (T_BENCH_* filled)."""

from __future__ import annotations

import pytest

from miles_engine.errors import SandboxUnsupportedError, TaskFormatError
from miles_env_terminal_bench.task import load_tb_task

from .tb_testkit import make_tb_task

COMPOSE = """\
services:
  client:
    build:
      context: image
      dockerfile: Dockerfile.client
    image: ${T_BENCH_TASK_DOCKER_CLIENT_IMAGE_NAME}
    working_dir: /work
    environment:
      - TEST_DIR=${T_BENCH_TEST_DIR}
      - MODE=${MODE:-fast}
      - EMPTY=
    volumes:
      - ${T_BENCH_TASK_LOGS_PATH}:${T_BENCH_CONTAINER_LOGS_PATH}
"""


def test_client_service_build_environment_and_workdir(tmp_path):
    task_dir = make_tb_task(tmp_path, files={"docker-compose.yaml": COMPOSE, "image/Dockerfile.client": "FROM x\n"})
    spec = load_tb_task(task_dir).sandbox_spec()
    assert spec.build is not None and spec.build.context_dir == (task_dir / "image").resolve()
    assert spec.build.dockerfile == "Dockerfile.client" and spec.image is None
    assert dict(spec.env) == {"TEST_DIR": "/tests", "MODE": "fast", "EMPTY": ""}
    assert spec.workdir == "/work" and "/work" in spec.paths and "/tests" in spec.paths


def test_client_service_with_an_image_and_mapping_environment(tmp_path):
    compose = "services:\n  client:\n    image: ubuntu:24.04\n    environment: {A: '1', B: '${T_BENCH_CONTAINER_LOGS_PATH}'}\n"
    spec = load_tb_task(make_tb_task(tmp_path, files={"docker-compose.yaml": compose})).sandbox_spec()
    assert spec.image == "ubuntu:24.04" and spec.build is None and dict(spec.env) == {"A": "1", "B": "/logs"}


def test_bad_client_services_are_named(tmp_path):
    cases = {
        "t1": ("services:\n  client:\n    image: x\n    environment: [\"K=${NOT_SET}\"]\n", r"variable \$\{NOT_SET\}"),
        "t2": ("services:\n  client:\n    environment: [A=1]\n", r"services\.client: needs 'build' or 'image'"),
        "t3": ("services:\n  client:\n    build: missing-dir\n", r"build\.context: '.*missing-dir' is not a directory"),
        "t4": ("services:\n  server:\n    image: x\n", r"needs a 'services' mapping with the 'client' service"),
    }
    for name, (compose, pattern) in cases.items():
        task = load_tb_task(make_tb_task(tmp_path, name, files={"docker-compose.yaml": compose}))
        with pytest.raises((TaskFormatError, SandboxUnsupportedError), match=pattern):
            task.sandbox_spec()


def test_client_limits_become_the_sandboxs_resources(tmp_path):
    compose = ("services:\n  client:\n    image: ubuntu:24.04\n    deploy: {resources: {limits: {cpus: '1.5', memory: 512M}}}\n"
               "  api:\n    image: ubuntu:24.04\n    cpus: 0.5\n    ports: ['8000:8000']\n")
    spec = load_tb_task(make_tb_task(tmp_path, files={"docker-compose.yaml": compose})).sandbox_spec()
    assert (spec.resources.cpus, spec.resources.memory_mb) == (1.5, 512)
    assert [(s.name, s.resources.cpus) for s in spec.services] == [("api", 0.5)]
