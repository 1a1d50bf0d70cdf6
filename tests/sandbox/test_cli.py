"""``miles sandbox exec`` / ``miles sandbox check`` through click's runner, building the
backend through the hub like any plugin backend."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from miles_engine.cli.main import cli, main
from miles_engine.errors import ConfigError
from miles_engine.hub import Hub

from .conftest import HAS_NS

pytestmark = pytest.mark.timeout(60)


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_exec_prints_a_structured_result():
    res = invoke("sandbox", "exec", "--backend", "local", "--", "echo out; echo err >&2; exit 4")
    data = json.loads(res.stdout)
    assert res.exit_code == 0
    assert set(data) == {"exit_code", "stdout", "stderr", "timed_out", "truncated", "duration_s", "isolation"}
    assert (data["exit_code"], data["stdout"], data["stderr"]) == (4, "out\n", "err\n")
    assert data["isolation"] == ("namespace" if HAS_NS else "process")


def test_exec_argv_timeout_env_and_workdir():
    res = invoke(
        "sandbox",
        "exec",
        "-o",
        "isolation=process",
        "--timeout",
        "0.5",
        "-e",
        "A=1",
        "--",
        "bash",
        "-c",
        "echo $A; sleep 5",
    )
    data = json.loads(res.stdout)
    assert data["timed_out"] and data["exit_code"] is None and data["stdout"] == "1\n"
    assert data["isolation"] == "process"


@pytest.mark.skipif(not HAS_NS, reason="needs namespaces")
def test_exec_network_and_workdir_options():
    res = invoke("sandbox", "exec", "--network", "none", "--workdir", "/logs", "--", "pwd; cat /proc/net/dev | wc -l")
    data = json.loads(res.stdout)
    assert data["stdout"].split() == ["/logs", "3"]


def test_exec_refuses_what_the_backend_cannot_isolate(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["sandbox", "exec", "-o", "isolation=process", "--network", "none", "--", "true"])
    assert exc.value.code == 2
    assert "network 'none'" in capsys.readouterr().err


def test_unknown_backend_option_names_the_key():
    with pytest.raises(ConfigError, match="isolaton.*did you mean 'isolation'"):
        Hub().create("sandbox", "local", {"isolaton": "process"})
    with pytest.raises(ConfigError, match="memory_mb"):
        Hub().create("sandbox", "local", {"memory_mb": -5})


def test_check_json_and_exit_codes():
    ok = invoke(
        "sandbox", "check", "-o", "isolation=process", "--json", "--case", "sleep_past_timeout", "--case", "env_secrets"
    )
    rows = json.loads(ok.stdout)
    assert ok.exit_code == 0
    assert [r["case"] for r in rows] == ["env_secrets", "sleep_past_timeout"]
    assert all({"case", "contained", "detail", "leftover_processes"} <= set(r) and r["contained"] for r in rows)
    bad = invoke("sandbox", "check", "-o", "isolation=process", "--case", "write_outside")
    assert bad.exit_code == 1
    assert "write_outside" in bad.stdout and "NOT contained" in bad.stdout


@pytest.mark.skipif(not HAS_NS, reason="needs namespaces")
def test_check_table_on_namespace_tier():
    res = invoke("sandbox", "check", "--case", "network_tcp", "--case", "read_host_files")
    assert res.exit_code == 0, res.stdout
    assert "isolation=namespace" in res.stdout and "2/2 contained" in res.stdout


def test_check_unknown_case():
    res = CliRunner().invoke(cli, ["sandbox", "check", "--case", "nope"])
    assert res.exit_code != 0 and "unknown case" in res.output
