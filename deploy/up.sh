#!/usr/bin/env bash
# Try the docker-compose deployment in one command: build what is missing, create the folders
# with the right owners, start a profile, register the connection in a private FLWR_HOME, run
# the app with `flwr run`, and stop everything this started.
#   deploy/up.sh [insecure|tls] [RUN_CONFIG]      e.g. deploy/up.sh tls "method='pfedc'"
# The steps on their own (the tests run them so, with a `flwr run` of their own between):
#   deploy/up.sh start PROFILE      engine, images, folders, site data, stack, connection
#   deploy/up.sh run PROFILE [RUN_CONFIG]
#   deploy/up.sh stop PROFILE       docker compose down; stops a dockerd that `start` started
# Settings (environment): PFLOWER_DIR (host folders, default deploy), PFLOWER_PORT (SuperLink
# port on the host, default 8000), COMPOSE_PROJECT_NAME (default pflower), FLWR_HOME (default
# $PFLOWER_DIR/flwr-home), PFLOWER_SITES (3: the compose file's sites).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = start ] || [ "${1:-}" = run ] || [ "${1:-}" = stop ]; then
  step=$1; shift
else
  step=all
fi
profile="${1:-insecure}"
shift || true
case "$profile" in insecure) suffix="" ;; tls) suffix="-tls" ;;
  *) echo "up: unknown profile '$profile' (insecure or tls)" >&2; exit 2 ;; esac
export PFLOWER_DIR="${PFLOWER_DIR:-deploy}" PFLOWER_PORT="${PFLOWER_PORT:-8000}"
export COMPOSE_PROJECT_NAME="${COMPOSE_PROJECT_NAME:-pflower}"
export FLWR_HOME="${FLWR_HOME:-$PFLOWER_DIR/flwr-home}"
export FLWR_DISABLE_UPDATE_CHECK=1 FLWR_TELEMETRY_ENABLED=0
sites="${PFLOWER_SITES:-3}"
engine_dir="$PFLOWER_DIR/engine"
connection=pflower-compose
PYTHON="${PYTHON:-python3}"
say() { echo "up: $*" >&2; }

compose() {
  local files=(-f docker-compose.yml)
  # each site's ClientApp on its own GPU where Docker has the NVIDIA runtime
  docker info --format '{{json .Runtimes}}' 2> /dev/null | grep -q nvidia \
    && files+=(-f docker-compose.gpu.yml)
  if docker compose version > /dev/null 2>&1; then
    docker compose "${files[@]}" --profile "$profile" "$@"
  else
    docker-compose "${files[@]}" --profile "$profile" "$@"
  fi
}

start() {
  mkdir -p "$engine_dir"
  deploy/docker-engine.sh start "$engine_dir" > /dev/null
  deploy/build-images.sh
  deploy/prepare.sh --sites "$sites" $([ "$profile" = tls ] && echo --tls)
  if [ -z "$(ls -A "$PFLOWER_DIR/sites/site-0/data")" ]; then
    say "no data in $PFLOWER_DIR/sites/site-*/data: writing the digits partitions there"
    "$PYTHON" -m fldata.export "$PFLOWER_DIR/sites" --sites "$sites" > /dev/null
  fi
  compose up -d --no-build "superlink$suffix" "superexec-serverapp$suffix"
  mkdir -p "$FLWR_HOME"
  local security='insecure = true'
  [ "$profile" = tls ] && security="root-certificates = \"$(realpath "$PFLOWER_DIR/certs/ca.crt")\""
  printf '[superlink]\ndefault = "%s"\n\n[superlink.%s]\naddress = "127.0.0.1:%s"\n%s\n' \
    "$connection" "$connection" "$PFLOWER_PORT" "$security" > "$FLWR_HOME/config.toml"
  for _ in $(seq 60); do
    flwr ls "$connection" > /dev/null 2>&1 && break
    sleep 1
  done
  [ "$profile" = tls ] && deploy/register-sites.sh "$connection" --sites "$sites"
  compose up -d --no-build
  say "$profile profile up; connection '$connection' in $FLWR_HOME/config.toml"
}

run() {
  flwr run . "$connection" --stream ${1:+--run-config "$1"}
}

stop() {
  compose down --remove-orphans
  local left
  left=$(docker ps -aq --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME")
  if [ -n "$left" ]; then
    say "containers of project $COMPOSE_PROJECT_NAME are still there: $left"; exit 1
  fi
  deploy/docker-engine.sh stop "$engine_dir"
}

case "$step" in
  start) start ;;
  run) run "${1:-}" ;;
  stop) stop ;;
  all)
    trap stop EXIT
    start
    run "${1:-}"
    ;;
esac
