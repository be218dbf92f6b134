#!/usr/bin/env bash
# Compare methods on your own run config over seeds (docs/comparing.md), e.g.:
#   bash scripts/compare.sh --methods fedavg,fedper,feddecomp --seeds 1,2,3 num-server-rounds=30
# Writes under ./outputs/compare-<UTC time>/ of the folder it is called from (or --out), never
# into this checkout's tracked files. A model or data module in that folder is importable.
set -euo pipefail
caller="$PWD"
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # the launcher; the runs get $caller
cd "$caller"
exec python -m launch.compare "$@"
