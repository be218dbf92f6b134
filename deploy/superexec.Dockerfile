# The app's dependencies on Flower's official SuperExec image (or its stand-in, see
# deploy/build-images.sh), pinned to the project's flwr. The app code itself arrives as a FAB
# with each `flwr run`; only dependencies live here. Build context: the repository root (see
# .dockerignore); BuildKit (docker compose build, or deploy/build-images.sh).
FROM flwr/superexec:1.42.0
# flwr is already in the image (same version): install the other dependencies, from
# deploy/wheelhouse when it has wheels for the image's Python, else from PyPI.
RUN --mount=type=bind,source=pyproject.toml,target=/tmp/pyproject.toml \
    --mount=type=bind,source=deploy/wheelhouse,target=/wheels \
    --mount=type=bind,source=deploy/pip-install.sh,target=/tmp/pip-install.sh \
    --mount=type=secret,id=pip-cert,mode=0444 \
    sh /tmp/pip-install.sh --deps-of /tmp/pyproject.toml
# The ServerApp and every ClientApp the SuperExec starts are forked from a process that has
# imported Flower and PyTorch once, not started and imported afresh for each message
# (launch/forkserver.py; with no fork server, the real commands run). It loads what a forked
# child does (launch/forkchild.py) from beside itself: the two files, and only them.
COPY launch/forkserver.py launch/forkchild.py /python/pflower/
ENTRYPOINT ["python", "-P", "/python/pflower/forkserver.py", "--exec", "flower-superexec"]
