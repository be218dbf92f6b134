#!/usr/bin/env bash
# Install (first time) and run the demo: `flwr run . --stream` of the default config (FedAvg,
# scikit-learn digits, Dirichlet 0.5, 10 clients) on a private local SuperLink that is stopped
# afterwards. Extra arguments are run-config overrides, e.g.:  scripts/demo.sh method=fedper lr=0.1
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
exec python -m launch.federation --supernodes "${SUPERNODES:-10}" "$@"
