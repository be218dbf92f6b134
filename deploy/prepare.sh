#!/usr/bin/env bash
# Create the host folders docker-compose.yml mounts, with the owners and modes the images' user
# (uid 49999) needs, under PFLOWER_DIR (default: deploy). Run it before `docker compose up`.
#   deploy/prepare.sh [--tls] [--sites N]
# Always: state/ outputs/ sites/site-<i>/state/ (written by the containers: owned by 49999),
#         sites/site-<i>/data/ (read by them: put each site's data here).
# --tls:  certs/ (deploy/make-certs.sh, once), keys/site-<i>{,.pub} (each SuperNode's
#         authentication key, ssh-keygen ECDSA P-384, once), secrets/{serverapp,site-<i>} (the
#         SuperExec shared secrets, once). Every file a container reads is handed to uid 49999:
#         keys and secrets 0600, certificates 0644; ca.key stays with you, 0600.
# Needs root (or sudo) to hand files to uid 49999; without either it says what to run.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${PFLOWER_DIR:-deploy}"
uid=49999
tls=0 sites=3
while [ $# -gt 0 ]; do
  case "$1" in
    --tls) tls=1; shift ;;
    --sites) sites=$2; shift 2 ;;
    *) echo "usage: deploy/prepare.sh [--tls] [--sites N]" >&2; exit 2 ;;
  esac
done
as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"
  elif command -v sudo > /dev/null && sudo -n true 2> /dev/null; then sudo "$@"
  else echo "prepare: run as root, or run: sudo $*" >&2; exit 1
  fi
}

mkdir -p "$dir/state" "$dir/outputs"
owned=("$dir/state" "$dir/outputs")
for ((i = 0; i < sites; i++)); do
  mkdir -p "$dir/sites/site-$i/data" "$dir/sites/site-$i/state"
  chmod 755 "$dir/sites/site-$i/data"
  owned+=("$dir/sites/site-$i/state")
done
private=() public=()
if [ "$tls" = 1 ]; then
  for tool in openssl:openssl ssh-keygen:openssh-client; do
    command -v "${tool%%:*}" > /dev/null && continue
    [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null \
      || { echo "prepare: ${tool%%:*} is missing (package ${tool#*:})" >&2; exit 1; }
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${tool#*:}" > /dev/null
  done
  [ -f "$dir/certs/ca.crt" ] || bash deploy/make-certs.sh --sites "$sites" "$dir/certs" > /dev/null
  mkdir -p "$dir/keys" "$dir/secrets"
  [ -f "$dir/secrets/serverapp" ] || (umask 077; head -c 32 /dev/urandom > "$dir/secrets/serverapp")
  private+=("$dir/certs/server.key" "$dir/secrets/serverapp")
  public+=("$dir/certs/ca.crt" "$dir/certs/server.pem")
  for ((i = 0; i < sites; i++)); do
    [ -f "$dir/keys/site-$i" ] || ssh-keygen -q -t ecdsa -b 384 -N "" -C "site-$i" \
      -f "$dir/keys/site-$i"
    [ -f "$dir/secrets/site-$i" ] || (umask 077; head -c 32 /dev/urandom > "$dir/secrets/site-$i")
    private+=("$dir/keys/site-$i" "$dir/secrets/site-$i" "$dir/certs/site-$i.key")
    public+=("$dir/keys/site-$i.pub" "$dir/certs/site-$i.pem")
  done
  chmod 600 "${private[@]}"
  chmod 644 "${public[@]}"
fi
as_root chown "$uid:$uid" "${owned[@]}" "${private[@]}" "${public[@]}"
echo "prepared $dir for $sites sites$([ "$tls" = 1 ] && echo ", TLS") (files for uid $uid)"
