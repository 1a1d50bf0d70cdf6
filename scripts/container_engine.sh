#!/usr/bin/env bash
# A private Docker engine for the docker sandbox backend's real-engine tests and local runs.
#
#   scripts/container_engine.sh start    install (root on Debian/Ubuntu, if missing), start dockerd
#                                        on a private socket + data root, build the base image once;
#                                        prints the environment to use it (eval "$(... start)")
#   scripts/container_engine.sh env      print that environment (engine already started)
#   scripts/container_engine.sh stop     stop the daemon this script started (containers go with it)
#   scripts/container_engine.sh status   say whether it runs
#   scripts/container_engine.sh podman-sidecars [remove]
#                                        let containers of one podman network reach each other where
#                                        the host's FORWARD policy is DROP (dockerd sets it): one rule,
#                                        bridged frames inside podman bridges only (see below)
#
# Idempotent: start on a running engine only prints the environment; the base image is built
# once (debootstrap --variant=minbase bookworm, ~1 min) and kept in the data root.
#
# Stand-ins: the docker backend stands in for public images it cannot get (no registry here) with
# small families built FROM the base image (python: +pip/venv, tb-python / tb-ubuntu: +tmux and
# asciinema, buildpack-deps, debian, ubuntu, alpine; see plugins/sandboxes/docker/README.md). The
# backend builds a family lazily on first use (apt from the Debian mirror over the build network,
# 2-40 s each, then cached on this engine as miles-standin-<family>:<hash>), so start stays short.
# State lives under $MILES_ENGINE_CACHE (default ~/.cache/miles-engine/docker). Nothing here
# touches a system Docker: the socket, data root, exec root and bridge are all private.
# Progress goes to stderr; stdout carries only the `export` lines.
set -euo pipefail

CACHE=${MILES_ENGINE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/miles-engine/docker}
SOCK="$CACHE/docker.sock"
EXEC_ROOT=${MILES_ENGINE_EXEC_ROOT:-/run/miles-docker}   # short: containerd's socket path is bounded
PIDFILE="$CACHE/dockerd.pid"
LOG="$CACHE/dockerd.log"
BASE_IMAGE=${MILES_BASE_IMAGE:-miles-base:bookworm}
MIRROR=${MILES_DEBIAN_MIRROR:-http://deb.debian.org/debian}
# The exact image map the backend applies unconditionally (to spec images and Dockerfile FROM
# lines): the base image *is* these (Debian minbase), and tests probe ubuntu:24.04 through it.
# Everything else (python:3.X-slim, t-bench bases, ...) goes through the backend's stand-in
# patterns, used only when the real image cannot be had. python:* is deliberately not here: the
# base has no pip.
MAPPED_REFS=${MILES_MAPPED_REFS:-"ubuntu:24.04 ubuntu:22.04 debian:bookworm debian:bookworm-slim"}
# What the base image carries beyond minbase: enough for terminal-bench's pytest-based tests.
BASE_PACKAGES=${MILES_BASE_PACKAGES:-python3-pytest,procps}

say() { echo "container_engine: $*" >&2; }
docker_() { DOCKER_HOST="unix://$SOCK" docker "$@"; }

running() {
  [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null && [ -S "$SOCK" ] \
    && docker_ version --format '{{.Server.Version}}' >/dev/null 2>&1
}

install_packages() {
  local need=()
  command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
  command -v docker >/dev/null 2>&1 || need+=(docker.io)
  command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
  [ ${#need[@]} -eq 0 ] && return 0
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    say "missing ${need[*]} and cannot install (needs root and apt-get)"; return 1
  fi
  say "installing ${need[*]} (apt)"
  local apt=(env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends)
  "${apt[@]}" "${need[@]}" >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 && "${apt[@]}" "${need[@]}" >/dev/null 2>&1; } \
    || { say "apt-get install ${need[*]} failed"; return 1; }
}

start_daemon() {
  running && return 0
  mkdir -p "$CACHE/data" "$EXEC_ROOT"
  rm -f "$SOCK"
  say "starting dockerd (socket $SOCK, data root $CACHE/data)"
  # A private bridge name and subnet so a system Docker's docker0 is never touched.
  nohup dockerd --host "unix://$SOCK" --data-root "$CACHE/data" --exec-root "$EXEC_ROOT" \
    --pidfile "$PIDFILE" --bridge none --log-level warn >"$LOG" 2>&1 </dev/null &
  local i
  for i in $(seq 1 60); do
    running && return 0
    sleep 0.5
  done
  say "dockerd did not answer within 30 s; last log lines:"; tail -n 15 "$LOG" >&2; return 1
}

ensure_network() {
  # Network mode 'public' uses this network (bridged, with NAT) instead of the default bridge.
  docker_ network inspect miles-public >/dev/null 2>&1 && return 0
  docker_ network create --driver bridge --subnet 172.31.250.0/24 \
    -o com.docker.network.bridge.name=miles-br0 miles-public >/dev/null
}

ensure_base_image() {
  if ! docker_ image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    local rootfs="$CACHE/rootfs"
    say "building base image $BASE_IMAGE from Debian packages (debootstrap minbase bookworm, +$BASE_PACKAGES)"
    rm -rf "$rootfs"
    debootstrap --variant=minbase --include="$BASE_PACKAGES" bookworm "$rootfs" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
      || { say "debootstrap failed; see $CACHE/debootstrap.log"; tail -n 5 "$CACHE/debootstrap.log" >&2; return 1; }
    rm -rf "$rootfs/var/cache/apt/archives/"*.deb "$rootfs/var/lib/apt/lists/"*
    tar -C "$rootfs" -c . | docker_ import --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
    rm -rf "$rootfs"
  fi
}

print_env() {
  echo "export DOCKER_HOST=unix://$SOCK"
  echo "export MILES_DOCKER_PUBLIC_NETWORK=miles-public"
  echo "export MILES_DOCKER_BUILD_NETWORK=host"   # the engine has no default bridge (--bridge none)
  echo "export MILES_DOCKER_STAND_IN_BASE=$BASE_IMAGE"   # what stand-in families are built FROM
  local ref map=""
  for ref in $MAPPED_REFS; do map="$map${map:+,}$ref=$BASE_IMAGE"; done
  echo "export MILES_DOCKER_IMAGE_MAP=$map"
}

# Podman's --internal networks get no accept rule from netavark, so where dockerd has set the
# FORWARD policy to DROP (with bridge-nf-call-iptables=1 bridged frames pass through FORWARD) two
# containers of one such network cannot reach each other: a sandbox's sidecars are unreachable.
# PODMAN_RULE accepts only frames *bridged* between two ports of one podman bridge (physdev
# --physdev-is-bridged: never routed traffic, so nothing to or from the outside network and
# nothing between two networks). It goes into DOCKER-USER (dockerd's chain for admin rules,
# kept across dockerd restarts) when there is one, else into FORWARD.
# An internal podman network still gives its bridge a host address (the gateway, where
# aardvark-dns answers), so a container on it could open connections to any host service
# listening on all addresses. The MILES-PODMAN-INPUT chain (jumped to from INPUT for podman
# bridges) lets DNS through and drops every other new connection to the host.
PODMAN_RULE=(-i podman+ -o podman+ -m physdev --physdev-is-bridged -m comment --comment "miles: podman intra-network" -j ACCEPT)
GUARD=MILES-PODMAN-INPUT
GUARD_JUMP=(-i podman+ -m comment --comment "miles: podman host guard" -j "$GUARD")

podman_sidecars() {
  local chain=FORWARD
  iptables -S DOCKER-USER >/dev/null 2>&1 && chain=DOCKER-USER
  if [ "${1:-}" = remove ]; then
    local c
    for c in DOCKER-USER FORWARD; do
      while iptables -C "$c" "${PODMAN_RULE[@]}" 2>/dev/null; do iptables -D "$c" "${PODMAN_RULE[@]}"; done
    done
    while iptables -C INPUT "${GUARD_JUMP[@]}" 2>/dev/null; do iptables -D INPUT "${GUARD_JUMP[@]}"; done
    iptables -F "$GUARD" 2>/dev/null && iptables -X "$GUARD"
    say "removed the podman intra-network rule and host guard"
    return 0
  fi
  if ! iptables -S "$GUARD" >/dev/null 2>&1; then
    iptables -N "$GUARD" && iptables -A "$GUARD" -p udp --dport 53 -j RETURN \
      && iptables -A "$GUARD" -p tcp --dport 53 -j RETURN \
      && iptables -A "$GUARD" -m conntrack --ctstate NEW -j DROP \
      || { say "iptables refused the host guard (root? conntrack match?)"; return 1; }
  fi
  iptables -C INPUT "${GUARD_JUMP[@]}" 2>/dev/null || iptables -I INPUT 1 "${GUARD_JUMP[@]}" \
    || { say "iptables refused the host guard jump"; return 1; }
  if ! iptables -C "$chain" "${PODMAN_RULE[@]}" 2>/dev/null; then
    iptables -I "$chain" 1 "${PODMAN_RULE[@]}" || { say "iptables refused the rule (root? physdev match?)"; return 1; }
  fi
  say "podman: intra-network rule in $chain, host guard $GUARD on INPUT"
}

case "${1:-}" in
  start)
    install_packages
    start_daemon
    ensure_network
    ensure_base_image
    print_env
    ;;
  env)
    running || { say "not running (run: $0 start)"; exit 1; }
    print_env
    ;;
  stop)
    if [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
      pid=$(cat "$PIDFILE")
      say "stopping dockerd (pid $pid)"
      kill -TERM "$pid"
      for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
    fi
    rm -f "$PIDFILE" "$SOCK"
    ;;
  podman-sidecars)
    podman_sidecars "${2:-}"
    ;;
  status)
    if running; then echo "running: unix://$SOCK"; else echo "stopped"; exit 1; fi
    ;;
  *)
    echo "usage: $0 start|env|stop|status|podman-sidecars [remove]" >&2; exit 2 ;;
esac
