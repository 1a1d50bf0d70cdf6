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
        "t4": ("services:\n  server:\n    image: x\n", r"no service is the agent's container: none sets container_name: "
               r"\$\{T_BENCH_TASK_DOCKER_CLIENT_CONTAINER_NAME\} \(terminal-bench's rule\) and none is named "
               r"'client' \(services: server\)"),
        "t5": ("services:\n  a:\n    image: x\n    container_name: ${T_BENCH_TASK_DOCKER_CLIENT_CONTAINER_NAME}\n"
               "  b:\n    image: y\n    container_name: ${T_BENCH_TASK_DOCKER_CLIENT_CONTAINER_NAME}\n",
               r"services a, b all set container_name to \$\{T_BENCH_TASK_DOCKER_CLIENT_CONTAINER_NAME\}"),
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


# terminal-bench's template, with the agent's service renamed: the agent is the service whose
# container_name is ${T_BENCH_TASK_DOCKER_CLIENT_CONTAINER_NAME}, not the one called "client"
RENAMED_AGENT = """\
services:
  dev-box:
    build:
      context: .
    image: ${T_BENCH_TASK_DOCKER_CLIENT_IMAGE_NAME}
    container_name: ${T_BENCH_TASK_DOCKER_CLIENT_CONTAINER_NAME}
    command: [ "sh", "-c", "sleep infinity" ]
    environment:
      - TEST_DIR=${T_BENCH_TEST_DIR}
    volumes:
      - ${T_BENCH_TASK_LOGS_PATH}:${T_BENCH_CONTAINER_LOGS_PATH}
      - ${T_BENCH_TASK_AGENT_LOGS_PATH}:${T_BENCH_CONTAINER_AGENT_LOGS_PATH}
  client:
    image: redis:7
    healthcheck:
      test: ["CMD", "redis-cli", "ping"]
"""


def test_the_agent_service_is_the_one_with_the_client_container_name(tmp_path):
    from miles_env_terminal_bench.compose import agent_service

    task_dir = make_tb_task(tmp_path, files={"docker-compose.yaml": RENAMED_AGENT, "Dockerfile": "FROM x\n"})
    assert agent_service(task_dir / "docker-compose.yaml", "answer") == "dev-box"
    spec = load_tb_task(task_dir).sandbox_spec()
    assert spec.build is not None and spec.build.context_dir == task_dir
    assert spec.env == {"TEST_DIR": "/tests"} and [sv.name for sv in spec.services] == ["client"]
    assert spec.services[0].image == "redis:7"


def test_a_lone_client_service_without_container_name_is_still_the_agent(tmp_path):
    from miles_env_terminal_bench.compose import agent_service

    task_dir = make_tb_task(tmp_path, files={"docker-compose.yaml": "services:\n  client:\n    image: ubuntu:24.04\n"})
    assert agent_service(task_dir / "docker-compose.yaml", "answer") == "client"
