#!/usr/bin/env bash
# Create .venv inside this checkout (if missing) and install the app with its test tools.
# Sourced by the other scripts. A .venv that is not a usable virtualenv of this checkout (a
# symlink, a dangling or foreign environment) is refused with one line instead of being used.
set -euo pipefail
# relative paths in the overrides are the user's, read from where the command was typed
export PFLOWER_CALLER_DIR="$PWD"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
venv_problem() {
  if [ -L .venv ]; then
    echo ".venv is a symlink (to $(readlink .venv)); the environment must live inside this checkout"
  elif [ ! -d .venv ]; then
    echo ".venv is not a directory"
  elif [ ! -f .venv/pyvenv.cfg ] || [ ! -x .venv/bin/python ]; then
    echo ".venv has no pyvenv.cfg or bin/python: not a virtualenv"
  elif ! prefix=$(.venv/bin/python -c 'import sys; print(sys.prefix)' 2>/dev/null); then
    echo ".venv/bin/python does not run (its base interpreter is gone?)"
  elif [ "$(cd "$prefix" && pwd -P)" != "$(cd .venv && pwd -P)" ]; then
    echo ".venv/bin/python belongs to another environment ($prefix)"
  elif [ -f .venv/bin/pip ] && ! head -1 .venv/bin/pip | grep -qF "$(cd .venv && pwd -P)/bin/" \
       && ! head -1 .venv/bin/pip | grep -qF "$PWD/.venv/bin/"; then
    echo ".venv was copied or moved from elsewhere (its scripts run $(head -1 .venv/bin/pip | cut -c3-))"
  elif ! .venv/bin/python -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo ".venv's Python is older than 3.11"
  fi
}
if [ -e .venv ] || [ -L .venv ]; then
  problem=$(venv_problem)
  if [ -n "$problem" ]; then
    echo "setup: $problem; remove it (rm -rf .venv) and run this again" >&2
    return 1 2>/dev/null || exit 1
  fi
else
  "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
    echo "setup: $PYTHON is older than Python 3.11; set PYTHON=python3.11 (or newer)" >&2
    return 1 2>/dev/null || exit 1; }
  "$PYTHON" -m venv .venv
fi
# Installed already? Found without importing (importing torch and flwr costs seconds that
# every launch, and every mistake in a run config, would pay).
if ! .venv/bin/python -c "import importlib.util as u, sys
sys.exit(not all(u.find_spec(m) for m in ('flwr', 'torch', 'ray', 'server_app')))" 2>/dev/null \
   || [ pyproject.toml -nt .venv/.installed ]; then
  # pip's output goes to a log, not the terminal: a machine's pip configuration can make it
  # print a warning per package (an index location it ignores, say). On a failure the
  # log's end is shown.
  echo "setup: installing the app and its tools into .venv (about 6.6 GB, a few minutes" \
       "the first time; pip's output: .venv/install.log)" >&2
  if ! { .venv/bin/python -m pip install --upgrade pip \
         && .venv/bin/python -m pip install -e ".[test]"; } > .venv/install.log 2>&1; then
    tail -n 20 .venv/install.log >&2
    echo "setup: pip install failed; the whole output is in .venv/install.log" >&2
    return 1 2>/dev/null || exit 1
  fi
  touch .venv/.installed
fi
export PATH="$PWD/.venv/bin:$PATH"
