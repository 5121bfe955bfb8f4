# kv-sidecar: the container engines run beside. Build: docker build -t kv-sidecar .
# Run with --ipc=host --pid=host (see README "Container"); the entry point is `sidecar serve`.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml constraints.txt README.md ./
COPY pools ./pools
COPY sidecar ./sidecar
COPY api ./api
COPY loadtest ./loadtest
# the gpu extra (cuda-python) enables the cuda_ipc transport; it imports fine without a GPU
ARG EXTRAS=gpu
RUN pip install --no-cache-dir -c constraints.txt ".[${EXTRAS}]" \
 && useradd --system --home /data kv \
 && mkdir -p /data && chown kv /data
ENV SIDECAR_DATA_DIR=/data SIDECAR_HOST=127.0.0.1
# Runs as root by default: opening an engine's /proc/<pid>/fd/<memfd> needs the engine's uid
# or root. Where engines run as a fixed uid, run the container as that uid (docker --user).
VOLUME /data
EXPOSE 8411
ENTRYPOINT ["sidecar"]
CMD ["serve"]
