# kv-sidecar: the container engines run beside. Build: docker build -t kv-sidecar .
# Run with --ipc=host --pid=host (see README "Container"); the entry point is `sidecar serve`.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml constraints.txt README.md ./
COPY pools ./pools
COPY sidecar ./sidecar
COPY api ./api
COPY loadtest ./loadtest
RUN pip install --no-cache-dir -c constraints.txt . \
 && useradd --system --home /data kv \
 && mkdir -p /data && chown kv /data
ENV SIDECAR_DATA_DIR=/data
VOLUME /data
EXPOSE 8411
ENTRYPOINT ["sidecar"]
CMD ["serve"]
