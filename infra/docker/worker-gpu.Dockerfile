# A GPU worker (Procfile `worker`): one vLLM engine per container, one GPU.
# Build from the repository root: docker build -f infra/docker/worker-gpu.Dockerfile .
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04
# The base image's Ubuntu release fixes python3's version; pinning a patch release breaks
# the build as soon as the archive moves on.
# hadolint ignore=DL3008
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
# This repository is the package: its pyproject pins the engine exactly (vllm==...).
# hadolint ignore=DL3013
RUN pip install --no-cache-dir '.[gpu]' && useradd --uid 10001 lorafleet \
    && mkdir -p /var/cache/lorafleet && chown lorafleet /var/cache/lorafleet
USER 10001
ENV LORAFLEET_CACHE_DIR=/var/cache/lorafleet LORAFLEET_METRICS_PORT=9400
EXPOSE 9400
# A shell, so that the settings expand (exec: Celery gets the signals, as PID 1: SIGTERM drains).
CMD ["sh", "-c", "exec celery -A worker.celery_app worker --pool threads --concurrency ${LORAFLEET_WORKER_CONCURRENCY:-256} --hostname ${LORAFLEET_WORKER_NAME:-worker@%h} --without-gossip --without-mingle --without-heartbeat --loglevel ${LORAFLEET_LOG_LEVEL:-INFO}"]
