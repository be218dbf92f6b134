#!/usr/bin/env bash
# Install (first time) and run the checks: ruff, then every test (unit and real Flower runs).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
ruff check .
python -m pytest -q "$@"
