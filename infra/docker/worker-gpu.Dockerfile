# A GPU worker (Procfile `worker`): one vLLM engine per container, one GPU.
# Build from the repository root: docker build -f infra/docker/worker-gpu.Dockerfile .
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/lorafleet
ENV PATH=/opt/lorafleet/bin:$PATH
WORKDIR /app
COPY pyproject.toml README.md Procfile ./
COPY contracts contracts
COPY gateway gateway
COPY worker worker
COPY lorafleet lorafleet
RUN pip install --no-cache-dir '.[gpu]' && useradd --uid 10001 lorafleet \
    && mkdir -p /var/cache/lorafleet && chown lorafleet /var/cache/lorafleet
USER lorafleet
ENV LORAFLEET_CACHE_DIR=/var/cache/lorafleet LORAFLEET_METRICS_PORT=9400
EXPOSE 9400
CMD celery -A worker.celery_app worker --pool threads --concurrency ${LORAFLEET_WORKER_CONCURRENCY:-256} --hostname ${LORAFLEET_WORKER_NAME:-worker@%h} --without-gossip --without-mingle --without-heartbeat --loglevel ${LORAFLEET_LOG_LEVEL:-INFO}
