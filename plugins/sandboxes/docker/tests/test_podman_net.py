"""podman_net: the host-firewall check before a podman sandbox gets an internal network (a fake
``iptables`` on PATH answers from a rules file)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from miles_engine.errors import SandboxUnsupportedError
from miles_sandbox_docker import podman_net

FAKE = """#!/bin/sh
# iptables -w 5 -C CHAIN RULE... -> 0 when "CHAIN RULE..." is a line of $RULES; -S FORWARD -> the policy
shift 2
if [ "$1" = -C ]; then shift; grep -qxF -- "$*" "$RULES"; exit $?; fi
if [ "$1" = -S ]; then echo "-P FORWARD $POLICY"; exit 0; fi
exit 2
"""


@pytest.fixture
def fake_iptables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "iptables").write_text(FAKE)
    (bin_dir / "iptables").chmod(0o755)
    rules = tmp_path / "rules"
    rules.write_text("")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("RULES", str(rules))
    monkeypatch.delenv("CONTAINER_HOST", raising=False)
    monkeypatch.setattr(podman_net.os, "geteuid", lambda: 0)
    nf = tmp_path / "bridge-nf-call-iptables"
    nf.write_text("1\n")

    def setup(policy: str, *lines: list[str]) -> Path:
        monkeypatch.setenv("POLICY", policy)
        rules.write_text("".join(" ".join(line) + "\n" for line in lines))
        return nf

    return setup


def test_both_rules_missing_under_a_drop_policy_are_named(fake_iptables):
    nf = fake_iptables("DROP")
    problems = podman_net.firewall_problems(nf)
    assert len(problems) == 2
    assert "reach the host's services through the network's gateway" in problems[0]
    assert "FORWARD policy is DROP" in problems[1]


def test_rules_in_place_or_an_accept_policy_leave_no_problem(fake_iptables):
    guard = ["INPUT", *podman_net.GUARD_JUMP]
    nf = fake_iptables("DROP", guard, ["DOCKER-USER", *podman_net.BRIDGED_RULE])
    assert podman_net.firewall_problems(nf) == []
    nf = fake_iptables("ACCEPT", guard)  # a podman-only host: bridged traffic is not dropped
    assert podman_net.firewall_problems(nf) == []
    nf.write_text("0\n")  # bridged frames not filtered: the FORWARD policy does not matter
    fake_iptables("DROP", guard)
    assert podman_net.firewall_problems(nf) == []


def test_refusal_names_services_cause_and_fix(fake_iptables, monkeypatch):
    nf = fake_iptables("DROP", ["INPUT", *podman_net.GUARD_JUMP])
    real = podman_net.firewall_problems
    monkeypatch.setattr(podman_net, "firewall_problems", lambda: real(nf))
    with pytest.raises(SandboxUnsupportedError, match=r"cannot run sidecar services db, api with network none on "
                       r"this host: containers of one podman internal network cannot reach each other.*"
                       r"run `scripts/container_engine.sh podman-sidecars` as root"):
        podman_net.refuse_unless_ready(["db", "api"])


def test_not_checked_without_root_or_for_a_remote_engine(fake_iptables, monkeypatch):
    nf = fake_iptables("DROP")
    monkeypatch.setenv("CONTAINER_HOST", "ssh://box/run/podman/podman.sock")
    assert podman_net.firewall_problems(nf) == []
    monkeypatch.delenv("CONTAINER_HOST")
    monkeypatch.setattr(podman_net.os, "geteuid", lambda: 1000)
    assert podman_net.firewall_problems(nf) == []
