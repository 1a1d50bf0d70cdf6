#!/usr/bin/env bash
# Checks that each in-repo plugin installs alone: for every plugins/<kind>/<name>/ (or the plugin
# dirs given as arguments) it makes a fresh venv, installs the core (miles-engine, base deps only),
# then `pip install <plugin dir>` by itself, and checks that
#   - `miles plugins --json` lists at least one component from each of the plugin's entry points,
#   - each entry-point module imports,
#   - `pip check` finds no broken requirement, and no torch was pulled in.
# With --contract it also installs pytest (+ the plugin's [test] extra, if any) and runs the
# plugin's own tests whose names contain "Contract" against the installed (non-editable) copy.
#
# Plugins are copied to a scratch dir before installing, so pip's in-tree build never writes
# build/ or *.egg-info into the checkout. Neither the core nor the plugins are on PyPI, so an
# in-repo dependency of a plugin (terminal-tasks needs miles-env-harbor) is installed from its
# plugin dir first, like the core.
#
# Slow (a venv per plugin): not part of the pytest suite.
#   scripts/check_plugin_installs.sh [--contract] [--keep] [plugins/<kind>/<name> ...]
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PYTHON=${PYTHON:-python3.11}
CONTRACT=0 KEEP=0
plugins=()
for arg in "$@"; do
  case "$arg" in
    --contract) CONTRACT=1 ;;
    --keep) KEEP=1 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    -*) echo "unknown option '$arg' (allowed: --contract, --keep)" >&2; exit 2 ;;
    *) [ -f "$arg/pyproject.toml" ] || { echo "'$arg' is not a plugin dir (no pyproject.toml in it)" >&2; exit 2; }
       plugins+=("${arg%/}") ;;
  esac
done
if [ ${#plugins[@]} -eq 0 ]; then
  for d in plugins/*/*/; do [ -f "$d/pyproject.toml" ] && plugins+=("${d%/}"); done
fi

WORK=$(mktemp -d /tmp/miles-plugin-installs.XXXXXX)
cleanup() { [ "$KEEP" = 1 ] && echo "kept $WORK" >&2 || rm -rf "$WORK"; }
trap cleanup EXIT
mkdir -p "$WORK/src" "$WORK/venvs" "$WORK/logs" "$WORK/wheels"

# The machine's pip constraints (if any) plus the one torch this project allows, should a
# plugin's dependencies ever pull torch in.
{ f=$("$PYTHON" -m pip config get global.constraint 2>/dev/null) && [ -f "$f" ] && cat "$f"; echo "torch==2.13.0"; } \
  > "$WORK/constraints.txt"
export PIP_CONSTRAINT="$WORK/constraints.txt" PIP_DISABLE_PIP_VERSION_CHECK=1

copy_clean() {  # copy_clean SRC DEST: the source tree without build outputs
  mkdir -p "$2"
  tar -C "$1" --exclude=build --exclude=dist --exclude='*.egg-info' --exclude=__pycache__ \
      --exclude=.pytest_cache -cf - . | tar -C "$2" -xf -
}

# project name -> plugin dir, for in-repo dependencies
declare -A DIST_DIR
for d in plugins/*/*/; do
  [ -f "$d/pyproject.toml" ] || continue
  n=$("$PYTHON" -c 'import sys,tomllib; print(tomllib.load(open(sys.argv[1],"rb"))["project"]["name"])' "$d/pyproject.toml")
  DIST_DIR[$n]=${d%/}
done

echo "building the core wheel ..." >&2
mkdir -p "$WORK/src/core"
cp pyproject.toml README.md "$WORK/src/core/"
copy_clean miles_engine "$WORK/src/core/miles_engine"
copy_clean recipes "$WORK/src/core/recipes"  # miles_engine/recipes is a symlink to it
if ! "$PYTHON" -m pip wheel -q --no-deps -w "$WORK/wheels" "$WORK/src/core" >"$WORK/logs/core.log" 2>&1; then
  cat "$WORK/logs/core.log" >&2; echo "could not build the core wheel (log above)" >&2; exit 1
fi
CORE_WHEEL=$(ls "$WORK"/wheels/miles_engine-*.whl)

# Reads a plugin's pyproject: dist name, in-repo deps, entry-point modules, has-test-extra.
read_pyproject() {
  "$PYTHON" - "$1/pyproject.toml" "${!DIST_DIR[@]}" <<'EOF'
import re, sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
in_repo = set(sys.argv[2:])
deps = [re.split(r"[\s<>=!~\[;]", d, maxsplit=1)[0] for d in p.get("dependencies", [])]
print(p["name"])
print(" ".join(d for d in deps if d in in_repo))
print(" ".join(sorted(set(p.get("entry-points", {}).get("miles", {}).values()))))
print("1" if "test" in p.get("optional-dependencies", {}) else "0")
EOF
}

# Checks `miles plugins --json` against the entry-point modules; prints the components found.
check_listing() {  # check_listing VENV DIST MODULES...
  local venv=$1 dist=$2; shift 2
  "$venv/bin/miles" plugins --json >"$venv/plugins.json" 2>"$venv/plugins.err" || {
    echo "'miles plugins --json' failed: $(tail -n 3 "$venv/plugins.err")"; return 1; }
  "$venv/bin/python" - "$venv/plugins.json" "$dist" "$@" <<'EOF'
import json, sys
rows = json.load(open(sys.argv[1]))
dist, modules = sys.argv[2], sys.argv[3:]
mine = [r for r in rows if r.get("distribution") == dist]
missing = [m for m in modules if not any(r.get("module") == m for r in mine)]
names = ",".join(f"{r['kind']}:{r['name']}" for r in mine)
if missing or not mine:
    print(f"no components from entry point module(s) {missing or modules} (listed: {names or 'none'})")
    sys.exit(1)
print(names)
EOF
}

rows=()
failed=0
for plugin in "${plugins[@]}"; do
  slug=${plugin#plugins/}; slug=${slug//\//-}
  venv="$WORK/venvs/$slug" log="$WORK/logs/$slug.log"
  start=$(date +%s)
  mapfile -t meta < <(read_pyproject "$plugin")
  dist=${meta[0]} prereqs=${meta[1]} modules=${meta[2]} has_test=${meta[3]}
  installed=no listed="-" contract="-" note=""
  echo "== $plugin ($dist)" >&2
  {
    "$PYTHON" -m venv "$venv" && "$venv/bin/python" -m pip install -q "$CORE_WHEEL" || note="core install failed"
    for dep in $prereqs; do
      [ -n "$note" ] && break
      copy_clean "${DIST_DIR[$dep]}" "$WORK/src/dep-$dep"
      "$venv/bin/python" -m pip install -q "$WORK/src/dep-$dep" || note="in-repo dependency $dep failed to install"
    done
  } >"$log" 2>&1
  if [ -z "$note" ]; then
    copy_clean "$plugin" "$WORK/src/$slug"
    if "$venv/bin/python" -m pip install -q "$WORK/src/$slug" >>"$log" 2>&1; then
      installed=yes
    else
      note="pip install failed: $(grep -m1 -E 'ERROR|error:' "$log")"
    fi
  fi
  if [ "$installed" = yes ]; then
    if out=$(check_listing "$venv" "$dist" $modules); then listed=$out; else listed=no; note="$out"; fi
    for m in $modules; do
      "$venv/bin/python" -c "import importlib, sys; importlib.import_module(sys.argv[1])" "$m" >>"$log" 2>&1 \
        || { installed=no; note="import $m failed: $(tail -n 1 "$log")"; }
    done
    "$venv/bin/python" -m pip check >>"$log" 2>&1 || { installed=no; note="pip check: $(tail -n 1 "$log")"; }
    if "$venv/bin/python" -m pip show -q torch >/dev/null 2>&1; then
      note="${note:+$note; }torch $("$venv/bin/python" -m pip show torch | sed -n 's/^Version: //p') was pulled in"
    fi
  fi
  if [ "$CONTRACT" = 1 ] && [ "$installed" = yes ]; then
    extra=""; [ "$has_test" = 1 ] && extra="$WORK/src/$slug[test]"
    if "$venv/bin/python" -m pip install -q pytest pytest-timeout $extra >>"$log" 2>&1; then
      # --rootdir/-c: the plugin copy's own pyproject (no pytest config); importlib mode keeps the
      # copy off sys.path, so the tests exercise the installed package.
      (cd "$WORK/src/$slug" && "$venv/bin/python" -m pytest tests -q -x -k Contract -p no:cacheprovider \
          --import-mode=importlib --timeout=300 -c pyproject.toml --rootdir . >>"$log" 2>&1)
      case $? in
        0) contract=$(grep -E '^[0-9]+ (passed|skipped)' "$log" | tail -n 1 | sed -E 's/ in [0-9.]+s.*//') ;;
        5) contract=FAILED; note="${note:+$note; }no contract tests (no test id contains 'Contract')" ;;
        *) contract=FAILED; note="${note:+$note; }contract: $(grep -E 'passed|failed|error' "$log" | tail -n 1)" ;;
      esac
    else
      contract="no pytest"; note="${note:+$note; }could not install pytest / test extra"
    fi
  fi
  secs=$(( $(date +%s) - start ))
  [ "$installed" = yes ] && [ "$listed" != no ] && [ "$contract" != FAILED ] || failed=$((failed + 1))
  rows+=("$plugin|$installed|$listed|$contract|$secs|$note")
  [ "$KEEP" = 1 ] || rm -rf "$venv"
done

{
  echo "plugin|installed ok|components listed|contract tests|seconds|note"
  printf '%s\n' "${rows[@]}"
} | column -t -s '|'
echo "$(( ${#plugins[@]} - failed ))/${#plugins[@]} plugins ok${KEEP:+}$([ "$KEEP" = 1 ] && echo " (venvs and logs in $WORK)")"
[ "$failed" -eq 0 ]
