"""A hot adapter the live workers of its base model could not pin is refused at publish
(``pins_exceed_slots``), before anything is uploaded or registered. A private Redis
database, the session's S3 bucket (content-addressed: a blob for other bytes is a new key)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from botocore.exceptions import ClientError
from redis import Redis

from contracts.digests import manifest_of
from contracts.errors import ErrorCode
from contracts.keys import POOLS, WORKERS_INDEX, worker_key
from contracts.queues import Tier, pool_id, queue_for
from contracts.storage import blob_key
from lorafleet.publish import Publisher
from lorafleet.registry import Registry, RegistryError
from lorafleet.stack import LocalStack
from lorafleet.validation import ADAPTER_FILES
from tests.helpers import fixture_publisher, new_adapter

PRIVATE_DB = 5


@pytest.fixture
def private(infra: LocalStack) -> Iterator[Redis]:
    redis = Redis.from_url(
        infra.redis_url.rsplit("/", 1)[0] + f"/{PRIVATE_DB}", decode_responses=True
    )
    redis.flushdb()
    yield redis
    redis.flushdb()
    redis.close()


def _announce(redis: Redis, publisher: Publisher, name: str, max_loras: int, queues: str) -> None:
    record = {
        "worker_id": name,
        "state": "serving",
        "base_model": publisher.base_model.model_dump(),
        "max_loras": max_loras,
        "queues": queues.split(","),
    }
    redis.set(worker_key(name), json.dumps(record), ex=60)
    redis.sadd(WORKERS_INDEX, name)


def _adapters(tmp_path: Path, fixtures_dir: Path, count: int) -> list[Path]:
    paths = []
    for index in range(count):
        spec = new_adapter(tmp_path, f"pin-{index}", 77_000 + index, fixtures_dir)
        paths.append(tmp_path / spec.name)
    return paths


def _uploaded(infra: LocalStack, path: Path) -> bool:
    weights = manifest_of(path, ADAPTER_FILES).files[1]
    try:
        infra.s3().head_object(Bucket=infra.settings.s3_bucket, Key=blob_key(weights.sha256))
    except ClientError:
        return False
    return True


def test_a_hot_adapter_beyond_the_pools_pins_is_refused_before_anything_is_published(
    private: Redis, infra: LocalStack, fixtures_dir: Path, tmp_path: Path
) -> None:
    registry = Registry(private)
    publisher = fixture_publisher(registry, infra, fixtures_dir)
    first, second, third, fourth = _adapters(tmp_path, fixtures_dir, 4)
    base = publisher.base_model.digest
    hot = queue_for(Tier.HOT, base)
    # Two workers of the pool: the one with 3 slots pins 2, the one with 2 pins 1.
    _announce(private, publisher, "h:1:a", 3, f"{hot},{queue_for(Tier.WARM, base)}")
    _announce(private, publisher, "h:2:b", 2, hot)
    # A worker that does not take the hot queue does not pin: it does not count.
    _announce(private, publisher, "h:3:c", 1, queue_for(Tier.COLD, base))
    assert private.hget(POOLS, pool_id(base)) is None
    publisher.publish(first, "pin-a", Tier.HOT)
    # publishing made the pool known (the gateways report and scale it from now on)
    assert private.hget(POOLS, pool_id(base)) == publisher.base_model.model_dump_json()
    assert publisher.publish(first, "pin-a", Tier.HOT).alias == "pin-a"  # the same again
    with pytest.raises(RegistryError) as refused:
        publisher.publish(second, "pin-b", Tier.HOT)
    assert refused.value.code == ErrorCode.PINS_EXCEED_SLOTS
    assert "pin at most 1" in refused.value.message and "pin-a" in refused.value.message
    # Nothing left behind: no record, no blob.
    assert registry.get("pin-b") is None
    assert not _uploaded(infra, second)
    # The same bytes as warm are fine, and under another alias the hot revision is no new pin.
    assert publisher.publish(second, "pin-b", Tier.WARM).tier == Tier.WARM
    again = publisher.publish(first, "pin-a-again", Tier.HOT)
    assert again.digest == publisher.publish(first, "pin-a", Tier.HOT).digest
    # Retiring a hot adapter frees its pin.
    registry.retire("pin-a")
    registry.retire("pin-a-again")
    assert publisher.publish(third, "pin-c", Tier.HOT).tier == Tier.HOT
    # With no worker of the pool up there is nothing to check against: a worker that starts
    # pins what fits and serves the rest unpinned (worker.runtime).
    private.delete(worker_key("h:1:a"), worker_key("h:2:b"))
    assert publisher.publish(fourth, "pin-d", Tier.HOT).tier == Tier.HOT
    shutil.rmtree(tmp_path, ignore_errors=True)
