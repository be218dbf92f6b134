# Stand-ins for Flower's official images flwr/superlink, flwr/supernode and flwr/superexec,
# built by deploy/build-images.sh under exactly those tags only when they are not available
# (no registry). Laid out as the official ones: the Flower CLIs in a virtualenv at /python/venv
# owned by the non-root user `app` (uid 49999, home and working directory /app), one target per
# component with that component's entrypoint. What differs (README "Deployment"): Debian
# bookworm and its Python 3.11 instead of Ubuntu 24.04 and a Python built from source.
ARG BASE_IMAGE=pflower/debian-base:bookworm
FROM ${BASE_IMAGE} AS base
ARG FLWR_VERSION
RUN useradd --no-create-home --home-dir /app -c "" --uid 49999 app \
 && mkdir -p /app && chown -R app:app /app \
 && python3 -m venv /python/venv
ENV PATH=/python/venv/bin:$PATH
RUN --mount=type=bind,source=deploy/wheelhouse,target=/wheels \
    --mount=type=bind,source=deploy/pip-install.sh,target=/usr/local/bin/pip-install \
    --mount=type=secret,id=pip-cert \
    pip-install "flwr==${FLWR_VERSION}" && chown -R app:app /python/venv
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONIOENCODING=UTF-8 \
    LANG=C.UTF-8 \
    LC_ALL=C.UTF-8 \
    HOME=/app
LABEL org.pflower.stand-in="flwr ${FLWR_VERSION}, Debian bookworm, Python 3.11"
WORKDIR /app
USER app

FROM base AS superlink
ENTRYPOINT ["flower-superlink"]

FROM base AS supernode
ENTRYPOINT ["flower-supernode"]

FROM base AS superexec
ENTRYPOINT ["flower-superexec"]
