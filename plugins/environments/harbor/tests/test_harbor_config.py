"""task.toml: every schema spelling from 1.0 to 1.4, and malformed files naming file, field and line."""

from __future__ import annotations

import pytest

from miles_engine.errors import TaskFormatError
from miles_env_harbor.config import parse_size_mb, parse_task_config, resolve_env
from miles_env_harbor.toml_lines import toml_key_lines

V10 = """\
version = "1.0"

[metadata]
author_name = "A"
difficulty = "hard"
category = "debugging"
tags = ["c", "make"]

[verifier]
timeout_sec = 120.0

[agent]
timeout_sec = 300.0

[environment]
build_timeout_sec = 900.0
cpus = 2
memory = "4G"
storage = "10G"
allow_internet = false
"""

V14 = """\
schema_version = "1.4"
artifacts = ["/workspace/out.txt", { source = "/workspace/build", destination = "build" }]

[task]
name = "acme/fix-build"
description = "Fix the build"
authors = [{ name = "Ada", email = "ada@example.com" }]
keywords = ["build", "c"]

[metadata]
difficulty = "medium"
difficulty_explanation = "needs make"

[agent]
timeout_sec = 120.0
user = "agent"

[verifier]
timeout_sec = 60.0
env = { JUDGE = "x", KEY = "${MILES_TEST_KEY:-fallback}" }
user = "root"
environment_mode = "separate"

[verifier.environment]
docker_image = "acme/verifier:1"
memory_mb = 1024

[solution]
env = { HINT = "1" }

[environment]
docker_image = "acme/fix-build:1"
cpus = 1.5
memory_mb = 3072
storage_mb = 2048
gpus = 0
env = { LANG = "C.UTF-8" }
workdir = "/workspace"
network_mode = "allowlist"
allowed_hosts = ["pypi.org"]
"""


def test_schema_1_0_spellings_are_normalised():
    cfg = parse_task_config(V10, source="t/task.toml")
    assert cfg.schema == "1.0"
    env = cfg.environment
    assert (env.effective_memory_mb, env.effective_storage_mb) == (4096, 10240)
    assert env.declared_network() == "no-network"
    assert env.explicit_resources() == {"cpus": 2, "memory_mb": 4096, "disk_mb": 10240}
    assert (cfg.agent.timeout_sec, cfg.verifier.timeout_sec) == (300.0, 120.0)
    assert (cfg.difficulty, cfg.category, cfg.tags) == ("hard", "debugging", ("c", "make"))


def test_schema_1_4_full_file():
    cfg = parse_task_config(V14, source="t/task.toml")
    assert cfg.schema == "1.4" and cfg.task is not None and cfg.task.name == "acme/fix-build"
    assert cfg.tags == ("build", "c") and cfg.description == "Fix the build"
    assert cfg.agent.user == "agent" and cfg.verifier.user == "root"
    assert cfg.verifier.environment_mode == "separate"
    assert cfg.verifier.environment is not None and cfg.verifier.environment.docker_image == "acme/verifier:1"
    env = cfg.environment
    assert (env.docker_image, env.workdir, env.network_mode, env.allowed_hosts) == (
        "acme/fix-build:1", "/workspace", "allowlist", ["pypi.org"])
    assert env.explicit_resources() == {"cpus": 1.5, "memory_mb": 3072, "disk_mb": 2048}
    assert cfg.solution.env == {"HINT": "1"}
    assert cfg.artifact_paths() == ["/workspace/out.txt", "/workspace/build"]
    assert cfg.unknown_keys == []


@pytest.mark.parametrize("spelling", ['version = "1.0"', *(f'schema_version = "1.{i}"' for i in range(5))])
def test_every_schema_version_is_accepted(spelling):
    assert parse_task_config(f"{spelling}\n[verifier]\ntimeout_sec = 5\n", source="x").verifier.timeout_sec == 5


def test_defaults_are_harbors():
    cfg = parse_task_config("", source="x")
    assert cfg.schema == "1.0" and cfg.verifier.environment_mode == "shared"
    assert (cfg.agent.timeout_sec, cfg.verifier.timeout_sec) == (600.0, 600.0)
    env = cfg.environment
    assert (env.cpus, env.memory_mb, env.storage_mb, env.gpus) == (1, 2048, 10240, 0)
    assert env.explicit_resources() == {} and env.declared_network() is None


def test_unknown_sections_and_keys_are_tolerated_and_listed():
    cfg = parse_task_config('schema_version = "1.4"\n[future]\nx = 1\n[environment]\nshiny = true\n', source="x")
    assert cfg.unknown_keys == ["future", "environment.shiny"]


def test_network_mode_wins_over_allow_internet():
    cfg = parse_task_config('[environment]\nallow_internet = false\nnetwork_mode = "public"\n', source="x")
    assert cfg.environment.declared_network() == "public"


def test_malformed_toml_names_file_and_line():
    with pytest.raises(TaskFormatError, match=r"tasks/a/task\.toml: invalid TOML: .*line 3"):
        parse_task_config('[agent]\ntimeout_sec = 5\ncpus = = 2\n', source="tasks/a/task.toml")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('[agent]\ntimeout_sec = 5\n\n[environment]\ncpus = "many"\n', r"task\.toml:5: bad value for 'environment\.cpus' \(got 'many'\)"),
        ('[environment]\nmemory = "lots"\n', r"task\.toml:2: bad value for 'environment\.memory'.*'4G'"),
        ('[verifier]\nenvironment_mode = "sometimes"\n', r"task\.toml:2: bad value for 'verifier\.environment_mode'.*'shared' or 'separate'"),
        ('[verifier]\ntimeout_sec = -1\n', r"task\.toml:2: bad value for 'verifier\.timeout_sec'"),
        ('[verifier]\nenv = { A = 1 }\n', r"task\.toml:2: bad value for 'verifier\.env\.A'"),
        ('schema_version = "2.0"\n', r"task\.toml:1: schema_version = '2\.0' is a task schema this reader does not "
                                     r"know; this reader knows schema_version 1\.0, 1\.1, 1\.2, 1\.3, 1\.4"),
        ('version = 1.0\n', r"task\.toml:1: bad value for 'version'"),
        ('[environment]\nnetwork_mode = "intranet"\n', r"'environment\.network_mode'.*allowlist"),
        ('[environment]\nworkdir = "app"\n', r"'environment\.workdir'.*absolute"),
        ('[verifier.environment]\ncpus = "x"\n', r"task\.toml:2: bad value for 'verifier\.environment\.cpus'"),
        ('agent = 3\n', r"task\.toml:1: bad value for 'agent'"),
    ],
)
def test_bad_fields_name_file_field_and_line(text, needle):
    with pytest.raises(TaskFormatError, match=needle):
        parse_task_config(text, source="tasks/a/task.toml")


@pytest.mark.parametrize(("text", "mb"), [("4G", 4096), ("512M", 512), ("2GB", 2048), ("1Gi", 1024),
                                          ("1.5g", 1536), ("2048K", 2), ("1T", 1048576)])
def test_size_strings(text, mb):
    assert parse_size_mb(text) == mb


def test_key_lines_follow_tables():
    lines = toml_key_lines('a = 1\n[verifier]\n# c\ntimeout_sec = 2\n[verifier.environment]\n"cpus" = 3\n')
    assert lines == {"a": 1, "verifier": 2, "verifier.timeout_sec": 4, "verifier.environment": 5,
                     "verifier.environment.cpus": 6}


def test_env_templates_resolve_from_host(monkeypatch):
    monkeypatch.setenv("MILES_TEST_KEY", "secret")
    env = {"A": "plain", "B": "${MILES_TEST_KEY}", "C": "${MILES_UNSET_VAR:-dflt}"}
    monkeypatch.delenv("MILES_UNSET_VAR", raising=False)
    assert resolve_env(env, where="w") == {"A": "plain", "B": "secret", "C": "dflt"}
    with pytest.raises(TaskFormatError, match="w: D = .*MILES_UNSET_VAR, which is not set"):
        resolve_env({"D": "${MILES_UNSET_VAR}"}, where="w")


def test_steps_are_read_with_harbors_fields():
    cfg = parse_task_config(
        'multi_step_reward_strategy = "final"\n'
        '[[steps]]\nname = "one"\nmin_reward = 0.5\nartifacts = ["/app/x", { source = "/app/d", exclude = ["*.log"] }]\n'
        '[steps.agent]\ntimeout_sec = 5\n[steps.verifier]\nenv = { K = "v" }\nshiny = 1\n'
        '[[steps]]\nname = "two"\nmin_reward = { reward = 1.0, style = 0.5 }\n', source="t.toml")
    one, two = cfg.steps
    assert (one.agent.timeout_sec, one.verifier.env, one.verifier.timeout_sec) == (5.0, {"K": "v"}, None)
    assert cfg.reward_strategy == "final" and one.artifacts[1].exclude == ["*.log"]
    assert cfg.unknown_keys == ["steps[0].verifier.shiny"]
    assert one.min_reward_failure({"reward": 0.5}) is None
    assert one.min_reward_failure({"reward": 0.25}) == "reward = 0.25 is below min_reward 0.5"
    assert two.min_reward_failure({"reward": 1.0}) == "style = -inf is below min_reward 0.5"  # a missing key


@pytest.mark.parametrize(("text", "needle"), [
    ('multi_step_reward_strategy = "max"\n', r"t\.toml:1: bad value for 'multi_step_reward_strategy' \(got 'max'\).*'mean' or 'final'"),
    ('[[steps]]\nname = "../up"\n', r"t\.toml:1: bad value for 'steps\.0\.name'.*directory name under steps/"),
    ('[[steps]]\nname = "a"\n[[steps]]\nname = "a"\n', "step names must be unique; repeated: a"),
    ('steps = []\n', r"\[\[steps\]\] is declared but empty"),
    ('[[steps]]\nname = "a"\nmin_reward = "high"\n', r"bad value for 'steps\.0\.min_reward"),
])
def test_bad_steps_are_named(text, needle):
    with pytest.raises(TaskFormatError, match=needle):
        parse_task_config(text, source="t.toml")
