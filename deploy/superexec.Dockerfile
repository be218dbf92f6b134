# The app's dependencies on Flower's official SuperExec image, pinned to the project's flwr.
# The app code itself arrives as a FAB with each `flwr run`; only dependencies live here.
FROM flwr/superexec:1.41.0
WORKDIR /app
COPY --chown=app:app pyproject.toml .
# flwr is already in the image (same version); install the rest of the dependencies.
RUN sed -i 's/.*"flwr\[simulation\]==.*//' pyproject.toml \
 && python -m pip install --no-cache-dir .
ENTRYPOINT ["flower-superexec"]
