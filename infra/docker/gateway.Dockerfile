# The gateway (Procfile `web`); the same image runs the webhook workers (Procfile `webhooks`).
# Build from the repository root: docker build -f infra/docker/gateway.Dockerfile .
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md Procfile ./
COPY contracts contracts
COPY gateway gateway
COPY worker worker
COPY lorafleet lorafleet
# No extra: the gateway and the webhook worker need neither torch nor vLLM.
RUN pip install --no-cache-dir . && useradd --uid 10001 lorafleet
USER 10001
ENV PORT=8000 LORAFLEET_GATEWAY_HOST=0.0.0.0
EXPOSE 8000
# A shell, so that the settings expand (exec: the server gets the signals, as PID 1).
CMD ["sh", "-c", "exec uvicorn gateway.app:create_app --factory --loop uvloop --http gateway.http_protocol:BoundedHttpTools --host ${LORAFLEET_GATEWAY_HOST:-0.0.0.0} --port ${PORT:-8000} --timeout-keep-alive ${LORAFLEET_KEEP_ALIVE_S:-75}"]
