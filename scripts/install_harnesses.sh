#!/usr/bin/env bash
# Install the real coding-agent CLIs the harness tests drive (Codex CLI, Claude Code) from the
# npm registry into a cache directory, pinned, idempotent. Skips (exit 0, with the reason)
# when node/npm is missing or the registry is unreachable: the tests then skip themselves.
#   scripts/install_harnesses.sh   -> $MILES_HARNESS_DIR, else ~/.cache/miles-engine/harnesses, or for root
#                                     /var/cache/miles-engine/harnesses (a root backend runs each sandbox
#                                     under its own uid, which cannot read /root)
# Binaries: $DIR/node_modules/.bin/{codex,claude}
set -uo pipefail
if [ "$(id -u)" = 0 ]; then DEFAULT_DIR=/var/cache/miles-engine/harnesses; else DEFAULT_DIR=$HOME/.cache/miles-engine/harnesses; fi
DIR=${MILES_HARNESS_DIR:-$DEFAULT_DIR}
CODEX=${MILES_CODEX_VERSION:-0.169.0}
CLAUDE=${MILES_CLAUDE_CODE_VERSION:-2.1.328}

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  echo "install_harnesses: node/npm not found; the real Codex CLI / Claude Code tests will skip" >&2
  exit 0
fi
mkdir -p "$DIR" && chmod 755 "$DIR"
want="@openai/codex@$CODEX @anthropic-ai/claude-code@$CLAUDE"
if [ -f "$DIR/.installed" ] && [ "$(cat "$DIR/.installed")" = "$want" ] \
   && [ -x "$DIR/node_modules/.bin/codex" ] && [ -x "$DIR/node_modules/.bin/claude" ]; then
  exit 0
fi
[ -f "$DIR/package.json" ] || echo '{"name":"miles-harnesses","private":true}' > "$DIR/package.json"
# shellcheck disable=SC2086
if npm install --prefix "$DIR" --no-audit --no-fund --loglevel=error $want >"$DIR/install.log" 2>&1; then
  echo "$want" > "$DIR/.installed"
  echo "install_harnesses: $want in $DIR" >&2
else
  echo "install_harnesses: npm install failed (see $DIR/install.log); the harness tests will skip" >&2
fi
exit 0
