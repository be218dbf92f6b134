#!/usr/bin/env bash
# Make the images docker-compose.yml runs, building only what is missing or out of date:
#  - flwr/superlink, flwr/supernode, flwr/superexec at the project's Flower version: the official
#    images when they are here (with --pull: pulled from the registry first); otherwise local
#    stand-ins under exactly those tags (deploy/flower.Dockerfile) on a Debian base made offline
#    (debootstrap from the apt mirror, then docker import);
#  - pflower/superexec:<version>: the app's dependencies on flwr/superexec (deploy/superexec.Dockerfile).
# Wheels for the builds come from the host (deploy/wheelhouse/cpXY, pip wheel with the host's own
# pip configuration) when the host's Python matches the images'; otherwise the builds use PyPI,
# with the host's CA bundle passed as a build secret (PIP_CERT_FILE, default: the system bundle).
#   deploy/build-images.sh [--pull]
set -euo pipefail
cd "$(dirname "$0")/.."
pull=0
[ "${1:-}" = --pull ] && pull=1
FLWR_VERSION=$(sed -n 's/.*"flwr\[simulation\]==\([^"]*\)".*/\1/p' pyproject.toml)
APP_IMAGE="pflower/superexec:$FLWR_VERSION"
BASE_IMAGE="pflower/debian-base:bookworm"
PYTHON="${PYTHON:-python3}"
PIP_CERT_FILE="${PIP_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}"
say() { echo "build-images: $*" >&2; }

label() { docker image inspect -f "{{index .Config.Labels \"$2\"}}" "$1" 2>/dev/null || true; }
exists() { docker image inspect "$1" > /dev/null 2>&1; }

# BuildKit (RUN --mount): `docker buildx` where installed; a Docker CLI older than 23 builds with
# BuildKit itself (DOCKER_BUILDKIT=1), a newer one only through buildx (Debian's docker.io ships
# /usr/bin/docker 20.10 and no buildx).
docker_build() {
  if docker buildx version > /dev/null 2>&1; then
    docker buildx build --load "$@"
    return
  fi
  local cli version
  for cli in docker /usr/bin/docker; do
    version=$("$cli" version --format '{{.Client.Version}}' 2> /dev/null) || continue
    if [ "${version%%.*}" -lt 23 ]; then
      DOCKER_BUILDKIT=1 "$cli" build "$@"
      return
    fi
  done
  say "no BuildKit: install the docker buildx plugin (or Debian's docker.io)"
  exit 1
}

build() {  # build TAG INPUTS_HASH DOCKERFILE [docker build args]: skipped when up to date
  local tag=$1 inputs=$2 dockerfile=$3
  shift 3
  if [ "$(label "$tag" org.pflower.inputs)" = "$inputs" ]; then
    say "$tag is up to date"
    return
  fi
  say "building $tag"
  local secret=()
  [ -s "$PIP_CERT_FILE" ] && secret=(--secret "id=pip-cert,src=$PIP_CERT_FILE")
  docker_build -f "$dockerfile" -t "$tag" --label "org.pflower.inputs=$inputs" "${secret[@]}" "$@" .
}

debian_mirror() {
  local uri
  uri=$(grep -hsE '^(deb |URIs:)' /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
          /etc/apt/sources.list.d/*.sources | grep -v security \
        | grep -oE 'https?://[^ ]*/debian/?' | head -1)
  echo "${uri:-http://deb.debian.org/debian}"
}

make_base() {  # a minimal Debian bookworm with Python, made offline from the apt mirror
  exists "$BASE_IMAGE" && return
  if ! command -v debootstrap > /dev/null; then
    [ "$(id -u)" = 0 ] || { say "debootstrap is missing (apt-get install debootstrap)"; exit 1; }
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap > /dev/null
  fi
  local root
  root=$(mktemp -d /var/tmp/pflower-rootfs.XXXXXX)
  trap 'rm -rf "$root"' EXIT
  say "debootstrap bookworm from $(debian_mirror) (about a minute)"
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates,passwd \
    bookworm "$root" "$(debian_mirror)" > "$root.log" 2>&1 || { tail -20 "$root.log" >&2; exit 1; }
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root.log"
  tar -C "$root" -c . | docker import - "$BASE_IMAGE" > /dev/null
  rm -rf "$root"
  trap - EXIT
}

requirements() {  # what the images install: flwr, then the app's other dependencies
  echo "flwr==$FLWR_VERSION"
  sed -n '/^dependencies = \[/,/^\]/p' pyproject.toml | grep -o '"[^"]*"' | tr -d '"' \
    | grep -v '^flwr\['
}

python_tag() { "$@" -c 'import sys; print("cp%d%d" % sys.version_info[:2])'; }

fill_wheelhouse() {  # fill_wheelhouse TAG: the host's wheels for the images' Python, if it matches
  local tag=$1 dir="deploy/wheelhouse/$1" wanted
  if [ "$(python_tag "$PYTHON" 2> /dev/null)" != "$tag" ]; then
    say "host $PYTHON is not $tag: the builds install from PyPI"
    return
  fi
  wanted=$(requirements)
  if [ "$(cat "$dir/.requirements" 2> /dev/null)" = "$wanted" ]; then
    return
  fi
  say "collecting wheels for $tag into $dir"
  rm -rf "$dir" && mkdir -p "$dir"
  echo "$wanted" > "$dir/requirements.txt"
  "$PYTHON" -m pip wheel -q --disable-pip-version-check -w "$dir" -r "$dir/requirements.txt" 2>&1 \
    | grep -v "is neither a file nor a directory" >&2 || true
  ls "$dir"/torch-* > /dev/null 2>&1 || { say "pip wheel failed"; rm -rf "$dir"; exit 1; }
  echo "$wanted" > "$dir/.requirements"
}

# 1. Flower's images: official when here (or pulled), else stand-ins.
stand_ins=()
for component in superlink supernode superexec; do
  image="flwr/$component:$FLWR_VERSION"
  if [ "$pull" = 1 ] && docker pull -q "$image" > /dev/null 2>&1; then
    say "$image pulled"
  elif exists "$image" && [ -z "$(label "$image" org.pflower.stand-in)" ]; then
    say "$image is the official image"
  else
    stand_ins+=("$component")
  fi
done
if [ ${#stand_ins[@]} -gt 0 ]; then
  make_base
  tag=$(docker run --rm --entrypoint python3 "$BASE_IMAGE" -c \
        'import sys; print("cp%d%d" % sys.version_info[:2])')
else
  tag=$(docker run --rm --entrypoint python "flwr/superexec:$FLWR_VERSION" -c \
        'import sys; print("cp%d%d" % sys.version_info[:2])')
fi
fill_wheelhouse "$tag"
wheels=$(ls "deploy/wheelhouse/$tag" 2> /dev/null | grep '\.whl$' | sha256sum | cut -c1-16)
deps=$(requirements)
for component in "${stand_ins[@]}"; do
  inputs=$( { cat deploy/flower.Dockerfile deploy/pip-install.sh
              docker image inspect -f '{{.Id}}' "$BASE_IMAGE"; echo "$FLWR_VERSION wheels:$wheels"; } \
            | sha256sum | cut -c1-16)
  build "flwr/$component:$FLWR_VERSION" "$inputs" deploy/flower.Dockerfile \
    --target "$component" --build-arg "FLWR_VERSION=$FLWR_VERSION" --build-arg "BASE_IMAGE=$BASE_IMAGE"
done

# 2. The app's SuperExec image on top.
inputs=$( { cat deploy/superexec.Dockerfile deploy/pip-install.sh launch/forkserver.py \
                launch/forkchild.py
            docker image inspect -f '{{.Id}}' "flwr/superexec:$FLWR_VERSION"
            echo "$deps wheels:$wheels"; } \
          | sha256sum | cut -c1-16)
build "$APP_IMAGE" "$inputs" deploy/superexec.Dockerfile
say "ready: flwr/superlink:$FLWR_VERSION flwr/supernode:$FLWR_VERSION $APP_IMAGE"
