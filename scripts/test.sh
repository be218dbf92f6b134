#!/usr/bin/env bash
# Install (first time) and run the checks: ruff, then every test (unit and real Flower runs).
# Tests run in TEST_WORKERS pytest-xdist workers (default 3: the real runs spend much of their
# time waiting on processes and polls); tests that share a run or a resource keep to one worker
# (`xdist_group`). Extra arguments go to pytest: -m "not integration" for the unit tier.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
ruff check .
python -m pytest -q -n "${TEST_WORKERS:-3}" --dist loadgroup "$@"
