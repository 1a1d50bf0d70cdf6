"""What a root Podman's host firewall must hold before a sandbox gets an internal network.

A sandbox with services and network mode ``none`` gets an ``--internal`` network. On Podman
(netavark) two things then go wrong on a host where dockerd also runs, or where the host
firewall is strict:

- containers of the network cannot reach each other: dockerd sets the ``FORWARD`` policy to
  ``DROP`` (with ``bridge-nf-call-iptables=1`` bridged frames pass through ``FORWARD``) and
  netavark adds no accept rule for an internal network;
- the network's bridge keeps a host address (its gateway, where aardvark-dns answers), so a
  container could open connections to any host service listening on all addresses.

``scripts/container_engine.sh podman-sidecars`` adds one rule for each (frames bridged inside
one podman bridge accepted; new connections from podman bridges to the host dropped except
DNS). :func:`firewall_problems` checks both are there; a sandbox that would be unreachable or
under-isolated is refused with one error naming the cause and the command. Rootless Podman (its
bridges live in its own network namespace), a remote engine and a host without ``iptables``
are not checked.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from miles_engine.errors import SandboxUnsupportedError

BRIDGED_RULE = ["-i", "podman+", "-o", "podman+", "-m", "physdev", "--physdev-is-bridged", "-m", "comment",
                "--comment", "miles: podman intra-network", "-j", "ACCEPT"]
GUARD_JUMP = ["-i", "podman+", "-m", "comment", "--comment", "miles: podman host guard", "-j", "MILES-PODMAN-INPUT"]
FIX = "run `scripts/container_engine.sh podman-sidecars` as root once (see docs/docker-sandbox.md, Podman)"


def _iptables(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["iptables", "-w", "5", *args], capture_output=True, text=True, timeout=30)


def checkable() -> bool:
    """Whether this process can see the firewall a root Podman on this host uses."""
    remote = os.environ.get("CONTAINER_HOST", "")
    return os.geteuid() == 0 and shutil.which("iptables") is not None and (not remote or remote.startswith("unix://"))


def firewall_problems(bridge_nf: Path = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")) -> list[str]:
    """What keeps an internal podman network from being both reachable inside and closed to the host."""
    if not checkable():
        return []
    problems = []
    if _iptables("-C", "INPUT", *GUARD_JUMP).returncode != 0:
        problems.append("a container on a podman internal network can reach the host's services through the "
                        "network's gateway address (no 'miles: podman host guard' rule on INPUT)")
    policy = _iptables("-S", "FORWARD").stdout.splitlines()[:1]
    try:
        bridged_filtered = bridge_nf.read_text().strip() == "1"
    except OSError:
        bridged_filtered = False
    if policy == ["-P FORWARD DROP"] and bridged_filtered and not any(
            _iptables("-C", chain, *BRIDGED_RULE).returncode == 0 for chain in ("DOCKER-USER", "FORWARD")):
        problems.append("containers of one podman internal network cannot reach each other: the host's FORWARD "
                        "policy is DROP (dockerd sets it) and netavark adds no accept rule for an internal network")
    return problems


def refuse_unless_ready(services: list[str]) -> None:
    problems = firewall_problems()
    if problems:
        raise SandboxUnsupportedError(
            f"sandbox backend 'docker' (podman) cannot run sidecar services {', '.join(services)} with network "
            f"none on this host: {'; '.join(problems)}. To fix: {FIX}")
