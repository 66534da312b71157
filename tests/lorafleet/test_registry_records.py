"""A registry record that does not parse hides only itself: the gateway lists and admits the
other adapters, a worker still preloads, and the CLI lists, shows and retires it.

Everything runs on a private Redis database of the session's server (no worker, no engine):
the gateway in this process, the CLI as a user runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY
from redis import Redis

from contracts import metrics
from contracts.errors import ErrorCode
from contracts.keys import ADAPTERS_INDEX, adapter_key
from contracts.queues import Tier
from contracts.registry import AdapterRecord, UnreadableRecord
from gateway.app import create_app
from gateway.config import GatewaySettings
from lorafleet.registry import Registry, RegistryError
from lorafleet.stack import LOCAL_AWS, LocalStack
from lorafleet.tenants import Tenants
from tests.helpers import fixture_publisher, job_records, queued_messages
from worker.registry import preload_sets

REPO = Path(__file__).resolve().parents[2]
PRIVATE_DB = 4
GOOD = "rec-good"
BAD = "rec-bad-nan"


def _url(infra: LocalStack) -> str:
    return infra.redis_url.rsplit("/", 1)[0] + f"/{PRIVATE_DB}"


@pytest.fixture
def private(infra: LocalStack) -> Iterator[Redis]:
    """Database ``PRIVATE_DB``, emptied before and after."""
    redis = Redis.from_url(_url(infra), decode_responses=True)
    redis.flushdb()
    yield redis
    redis.flushdb()
    redis.close()


@pytest.fixture
def registry(private: Redis, infra: LocalStack, fixtures_dir: Path) -> Registry:
    """The private registry holding ``GOOD`` (hot) and four records that do not parse:
    ``BAD`` as a ``NaN`` alpha used to be stored (``null``), text that is not JSON, a record
    stored under another alias's name, and one missing its digest; channel ``rec-chan``
    points at ``BAD``."""
    registry = Registry(private)
    publisher = fixture_publisher(registry, infra, fixtures_dir)
    good = publisher.publish(fixtures_dir / "adapters" / "lora-02-r4-qv", GOOD, Tier.HOT)
    body = json.loads(good.model_dump_json())
    bad = {
        BAD: json.dumps({**body, "alias": BAD, "alpha": None}),
        "rec-not-json": "{alias: rec-not-json",
        "rec-other-name": good.model_dump_json(),
        "rec-no-digest": json.dumps({k: v for k, v in body.items() if k != "digest"}),
    }
    for alias, raw in bad.items():
        private.set(adapter_key(alias), raw)
        private.sadd(ADAPTERS_INDEX, alias)
    registry.set_channel("rec-chan", BAD)
    return registry


def _invalid_count() -> float:
    return REGISTRY.get_sample_value(metrics.REGISTRY_RECORDS_INVALID) or 0.0


def _job(adapter: str) -> dict[str, Any]:
    return {"adapter": adapter, "prompt": "hello", "sampling": {"max_tokens": 4}}


def _enqueued(redis: Redis) -> tuple[int, int]:
    """Job records and queued messages: what an admission leaves behind."""
    return job_records(redis), queued_messages(redis)


def test_the_gateway_lists_and_admits_the_others_and_refuses_only_the_bad_one(
    registry: Registry, private: Redis, infra: LocalStack
) -> None:
    tenants = Tenants(private)
    _, key = tenants.create("rec-acme")
    tenants.grant("rec-acme", "*")
    _, narrow_key = tenants.create("rec-narrow")
    tenants.grant("rec-narrow", GOOD)
    settings = GatewaySettings(redis_url=_url(infra), metrics_public=True)
    with TestClient(create_app(settings)) as client:
        client.headers["Authorization"] = f"Bearer {key}"
        models = client.get("/v1/models")
        assert models.status_code == 200, models.text
        assert [m["id"] for m in models.json()["data"]] == [GOOD]
        assert client.get(f"/v1/models/{GOOD}").status_code == 200
        assert client.get(f"/v1/models/{BAD}").json()["error"]["code"] == "adapter_not_found"

        admitted = client.post("/v1/jobs", json=_job(GOOD))
        assert admitted.status_code == 202, admitted.text
        before = _enqueued(private)
        for name in (BAD, "rec-chan", "rec-not-json", "rec-other-name", "rec-no-digest"):
            refused = client.post("/v1/jobs", json=_job(name))
            assert refused.status_code == 500, refused.text
            error = refused.json()["error"]
            assert error["code"] == ErrorCode.ADAPTER_UNAVAILABLE
            assert "registry record is unreadable" in error["message"]
            assert error["param"] == "adapter"
        assert _enqueued(private) == before
        scraped = client.get("/metrics").text
        assert f"{metrics.REGISTRY_RECORDS_INVALID} " in scraped

        # A tenant not granted the bad alias can't tell it exists.
        narrow = client.post(
            "/v1/jobs", json=_job(BAD), headers={"Authorization": f"Bearer {narrow_key}"}
        )
        assert narrow.status_code == 404 and narrow.json()["error"]["code"] == "adapter_not_found"

        registry.retire(BAD)
        retired = client.post("/v1/jobs", json=_job(BAD))
        assert retired.status_code == 410 and retired.json()["error"]["code"] == "adapter_retired"
        assert _enqueued(private) == before


def test_a_worker_preloads_the_others(registry: Registry, private: Redis) -> None:
    good = registry.require(GOOD)
    assert isinstance(good, AdapterRecord)
    counted = _invalid_count()
    hot, warm = preload_sets(private, good.base_model.digest)
    assert hot == [good] and warm == []
    # The record naming GOOD under another key is skipped, not taken for GOOD's twin.
    assert _invalid_count() == counted + 4


def test_registry_reports_unreadable_records_and_retires_them(
    registry: Registry, infra: LocalStack, fixtures_dir: Path
) -> None:
    entries = {entry.alias: entry for entry in registry.list()}
    assert isinstance(entries[GOOD], AdapterRecord)
    bad = entries[BAD]
    assert isinstance(bad, UnreadableRecord) and "alpha" in bad.reason
    other = entries["rec-other-name"]
    assert isinstance(other, UnreadableRecord) and GOOD in other.reason
    assert str(registry.retire(BAD)) == str(bad) and BAD in registry.retired()

    # New bytes under an unreadable alias are refused like under any taken alias.
    publisher = fixture_publisher(registry, infra, fixtures_dir)
    stored = registry.stored(BAD)
    with pytest.raises(RegistryError) as caught:
        publisher.publish(fixtures_dir / "adapters" / "lora-06-r4-qv", BAD, Tier.COLD)
    assert caught.value.code == ErrorCode.ALIAS_EXISTS
    assert "unreadable" in caught.value.message
    assert registry.stored(BAD) == stored


def _cli(infra: LocalStack, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "LORAFLEET_STATE_DIR": str(tmp_path / "state"),
        "LORAFLEET_REDIS_URL": _url(infra),
        "LORAFLEET_S3_ENDPOINT_URL": infra.s3_endpoint_url,
        **LOCAL_AWS,
    }
    return subprocess.run(
        [sys.executable, "-m", "lorafleet", "adapters", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_lists_shows_and_retires_an_unreadable_record(
    registry: Registry, infra: LocalStack, tmp_path: Path
) -> None:
    listed = _cli(infra, tmp_path, "list")
    assert listed.returncode == 0, listed.stderr
    # Rich expands the tabs: columns are whitespace-separated.
    rows = {line.split()[0]: line.split() for line in listed.stdout.splitlines()}
    assert rows[GOOD][1:3] == ["hot", "active"] and rows[GOOD][3].startswith("sha256:")
    assert rows[BAD][1:5] == ["-", "active", "unreadable:", "alpha:"]

    shown = _cli(infra, tmp_path, "show", BAD)
    assert shown.returncode == 1, shown.stderr
    assert "adapter_unavailable" in shown.stdout and '"alpha": null' in shown.stdout
    assert f"lorafleet adapters retire {BAD}" in shown.stdout

    retired = _cli(infra, tmp_path, "retire", BAD)
    assert retired.returncode == 0, retired.stderr
    assert f"retired {BAD}" in retired.stdout
    assert BAD in registry.retired()
    again = {
        line.split()[0]: line.split() for line in _cli(infra, tmp_path, "list").stdout.splitlines()
    }
    assert again[BAD][1:4] == ["-", "retired", "unreadable:"]
