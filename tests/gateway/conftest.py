"""A private gateway for admission tests: in this process, on its own Redis database.

No worker consumes that database, so admitted jobs stay admitted while a test counts them.
It needs no worker at all: the registry is copied from the session's database and the
base model's card is described from the fixture model, as a worker would publish it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
import uvicorn
from redis import Redis

from contracts.keys import ADAPTERS_INDEX, DEADLINES, POOLS, tenant_ledger_key
from contracts.registry import AdapterRecord, BaseModelRef
from contracts.tenants import ALL_ADAPTERS, TenantLimits
from gateway.app import create_app
from gateway.config import GatewaySettings
from gateway.http_protocol import BoundedHttpTools
from lorafleet.processes import free_port
from lorafleet.stack import CPU_ENGINE_DEFAULTS, LocalStack
from lorafleet.tenants import Tenants
from tests.helpers import job_records, pool_ledger_entries, queued_messages
from worker import model_card

PRIVATE_DB = 1


def admitted_state(redis: Redis, tenant: str) -> dict[str, int]:
    """Everything an admission (job or batch) or an upload can leave behind, counted; a
    refusal must leave all of it at zero."""
    return {
        "records": job_records(redis),
        "batches": len(list(redis.scan_iter("lorafleet:batch:*"))),
        "idempotency_keys": len(list(redis.scan_iter("lorafleet:idem:*"))),
        "files": len(list(redis.scan_iter("lorafleet:file:*"))),
        "pool_ledgers": pool_ledger_entries(redis),
        "tenant_ledger": int(redis.zcard(tenant_ledger_key(tenant))),  # type: ignore[arg-type]
        "queued": queued_messages(redis),
        "deadlines": int(redis.zcard(DEADLINES)),  # type: ignore[arg-type]
    }


NOTHING = {
    "records": 0,
    "batches": 0,
    "idempotency_keys": 0,
    "files": 0,
    "pool_ledgers": 0,
    "tenant_ledger": 0,
    "queued": 0,
    "deadlines": 0,
}


@contextmanager
def serving(settings: GatewaySettings) -> Iterator[str]:
    """The gateway app under uvicorn on a free port, in a thread; yields its base URL."""
    port = free_port()
    # The web command's event loop and protocol (the Procfile's ``--loop`` and ``--http``).
    config = uvicorn.Config(
        create_app(settings),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        lifespan="on",
        loop="uvloop",
        http=BoundedHttpTools,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="private-gateway", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "gateway did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="session")
def base_card(base_model: BaseModelRef) -> tuple[Any, str | None]:
    """The fixture model's card and tokenizer, described as the stack's worker describes
    them (the local stack's context length), without starting an engine."""
    from transformers import AutoTokenizer

    engine = SimpleNamespace(
        get_tokenizer=lambda: AutoTokenizer.from_pretrained(base_model.id),
        model_config=SimpleNamespace(
            max_model_len=int(CPU_ENGINE_DEFAULTS["LORAFLEET_MAX_MODEL_LEN"])
        ),
    )
    return model_card.describe(engine, base_model)


@pytest.fixture
def private_redis(
    infra: LocalStack, published: dict[str, AdapterRecord], base_card: tuple[Any, str | None]
) -> Iterator[Redis]:
    """Database ``PRIVATE_DB``, emptied, holding the session's registry (pools too) and the
    model card."""
    source = infra.redis()
    private = Redis.from_url(_url(infra, PRIVATE_DB), decode_responses=True)
    private.flushdb()
    for key in source.scan_iter("lorafleet:adapter:*"):
        private.set(key, source.get(key))  # type: ignore[arg-type]
    private.sadd(ADAPTERS_INDEX, *published)
    for key, value in source.hgetall(POOLS).items():  # type: ignore[union-attr]
        private.hset(POOLS, key, value)
    model_card.publish(private, *base_card)
    yield private
    private.flushdb()
    private.close()


def _url(stack: LocalStack, db: int) -> str:
    return stack.redis_url.rsplit("/", 1)[0] + f"/{db}"


@pytest.fixture
def private_gateway(infra: LocalStack, private_redis: Redis) -> Callable[..., Any]:
    """``private_gateway(**settings)``: a context manager serving a gateway on the private
    database with those settings."""

    def start(**overrides: Any) -> Any:
        options: dict[str, Any] = {"redis_url": _url(infra, PRIVATE_DB)} | overrides
        return serving(GatewaySettings(**options))

    return start


@pytest.fixture
def tenant_key(private_redis: Redis) -> Callable[..., str]:
    """``tenant_key(name, **limits)``: a new tenant granted every adapter; its key."""

    def make(name: str, **limits: Any) -> str:
        tenants = Tenants(private_redis)
        _, key = tenants.create(name, TenantLimits(**limits))
        tenants.grant(name, ALL_ADAPTERS)
        return key

    return make
