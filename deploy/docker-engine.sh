#!/usr/bin/env bash
# Make sure a Docker engine answers, starting one when none does (for CI machines and the
# tests; on a workstation Docker normally runs as a service and this does nothing).
#   deploy/docker-engine.sh start RUN_DIR   prints the pid of a dockerd it started (nothing when
#                                           one already answered); installs docker.io and
#                                           docker-compose with apt-get when they are missing
#   deploy/docker-engine.sh stop RUN_DIR    stops the dockerd that `start` started, by its pid
# Exit 3 (with one line why) when Docker cannot be started here: not root, or no apt-get.
set -euo pipefail
command=$1 run="${2:-/var/tmp/pflower-dockerd}"
mkdir -p "$run"
answers() { timeout 20 docker info > /dev/null 2>&1; }

case "$command" in
  start)
    if command -v docker > /dev/null && answers; then exit 0; fi
    if [ "$(id -u)" != 0 ]; then
      echo "no Docker engine answers and starting one needs root" >&2; exit 3
    fi
    if ! command -v dockerd > /dev/null || ! command -v docker > /dev/null \
       || ! { docker compose version || command -v docker-compose; } > /dev/null 2>&1; then
      command -v apt-get > /dev/null || { echo "no Docker engine, and no apt-get to install one" >&2; exit 3; }
      echo "docker-engine: installing docker.io and docker-compose" >&2
      apt-get update -q > "$run/apt.log" 2>&1 || true
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io docker-compose \
        >> "$run/apt.log" 2>&1 || { tail -5 "$run/apt.log" >&2; exit 1; }
    fi
    setsid dockerd --pidfile "$run/dockerd.pid" > "$run/dockerd.log" 2>&1 < /dev/null &
    echo $! > "$run/started.pid"
    for _ in $(seq 60); do
      if answers; then cat "$run/started.pid"; exit 0; fi
      kill -0 "$(cat "$run/started.pid")" 2> /dev/null || break
      sleep 1
    done
    echo "dockerd did not answer; see $run/dockerd.log:" >&2
    tail -5 "$run/dockerd.log" >&2
    kill "$(cat "$run/started.pid")" 2> /dev/null || true
    rm -f "$run/started.pid"
    exit 1
    ;;
  stop)
    [ -f "$run/started.pid" ] || exit 0
    pid=$(cat "$run/started.pid")
    kill -TERM "$pid" 2> /dev/null || true
    for _ in $(seq 30); do kill -0 "$pid" 2> /dev/null || break; sleep 1; done
    kill -KILL "$pid" 2> /dev/null || true
    rm -f "$run/started.pid"
    ;;
  *) echo "usage: deploy/docker-engine.sh start|stop [RUN_DIR]" >&2; exit 2 ;;
esac
