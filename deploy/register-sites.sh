#!/usr/bin/env bash
# Register each site's SuperNode authentication key (deploy/prepare.sh --tls made them) with
# the SuperLink, under the site's name; the SuperLink (--enable-supernode-auth) then accepts
# only these nodes. A key registered before is left as it is.
#   deploy/register-sites.sh CONNECTION [--sites N]      (CONNECTION: in $FLWR_HOME/config.toml)
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${PFLOWER_DIR:-deploy}"
connection=$1 sites=3
[ "${2:-}" = --sites ] && sites=$3
for ((i = 0; i < sites; i++)); do
  if out=$(flwr supernode register "$dir/keys/site-$i.pub" "$connection" --name "site-$i" 2>&1); then
    echo "site-$i: registered"
  elif grep -q "already in use" <<< "$out"; then
    echo "site-$i: already registered"
  else
    echo "$out" >&2
    exit 1
  fi
done
