#!/bin/sh
# pip install during an image build (deploy/flower.Dockerfile, deploy/superexec.Dockerfile).
# Wheels come from /wheels/cpXY (deploy/wheelhouse/cpXY, filled by deploy/build-images.sh from
# the host's own wheel cache) when that folder has any, with no index; otherwise from PyPI, with
# the CA bundle passed as the build secret `pip-cert` when there is one (it is never stored in
# the image).
#   pip-install.sh SPEC...                         e.g. flwr==1.42.0
#   pip-install.sh --deps-of pyproject.toml        the project's dependencies but flwr (in the image)
set -eu
if [ "$1" = --deps-of ]; then
  python - "$2" > /tmp/requirements.txt <<'PY'
import re, sys, tomllib
with open(sys.argv[1], "rb") as f:
    deps = tomllib.load(f)["project"]["dependencies"]
print("\n".join(d for d in deps if re.split(r"[\[=<>!~ ;]", d, maxsplit=1)[0] != "flwr"))
PY
  set -- -r /tmp/requirements.txt
fi
tag=$(python -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
if ls "/wheels/$tag/"*.whl > /dev/null 2>&1; then
  echo "pip-install: wheels from the build context's deploy/wheelhouse/$tag (no index)"
  set -- --no-index --find-links "/wheels/$tag" "$@"
elif [ -s /run/secrets/pip-cert ]; then
  export PIP_CERT=/run/secrets/pip-cert
fi
python -m pip install --no-cache-dir --disable-pip-version-check "$@"
rm -f /tmp/requirements.txt
