# kv-sidecar: the container engines run beside. Build: docker build -t kv-sidecar .
# Runs as the non-root user kv (uid 10001). Engines reach it through the engine socket in
# the /run/kv-sidecar volume (share it with their containers; see docs/security.md); shared
# memory needs no --pid=host or --ipc=host. CUDA IPC still needs the GPUs and --pid=host.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml setup.py constraints.txt README.md ./
COPY pools ./pools
COPY sidecar ./sidecar
COPY api ./api
# the gpu extra (cuda-python) enables the cuda_ipc transport; it imports fine without a GPU.
# No torch: the server needs none (it is the `engine` extra, for engine processes); the events
# extra (pyzmq, msgspec) serves --kv-events
ARG EXTRAS=gpu,events
# gcc for KV events' packer (sidecar/_evpack.c; optional: without it events pack in Python,
# slower) and the copy of a plan's runs (sidecar/_kvcopy.c; without it, memmove a run at a
# time from Python), removed once they are built. Unpinned apt packages (DL3008): the slim
# image's Debian replaces old versions on security updates, so a pin breaks the build
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && pip install --no-cache-dir -c constraints.txt ".[${EXTRAS}]" \
 && python -I -c "import sidecar._evpack, sidecar._kvcopy" \
 && apt-get purge -y gcc libc6-dev && apt-get autoremove -y && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --user-group --home /data kv \
 && mkdir -p /data /run/kv-sidecar && chown kv:kv /data /run/kv-sidecar \
 && chmod 0750 /run/kv-sidecar
ENV SIDECAR_DATA_DIR=/data SIDECAR_HOST=127.0.0.1 SIDECAR_SOCKET=/run/kv-sidecar/sidecar.sock
USER 10001:10001
VOLUME ["/data", "/run/kv-sidecar"]
EXPOSE 8411
ENTRYPOINT ["sidecar"]
CMD ["serve"]
