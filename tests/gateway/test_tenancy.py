"""Tenants, keys and grants through HTTP against the running gateway with real Redis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from redis import Redis
from redis.asyncio import Redis as AsyncRedis

from contracts.registry import AdapterRecord
from contracts.tenants import TenantLimits, key_hash
from gateway import access
from gateway.access import Access, Caller
from gateway.errors import ApiError
from lorafleet.client import auth_headers
from lorafleet.registry import Registry
from lorafleet.stack import LocalStack
from lorafleet.tenants import Tenants
from tests.helpers import job_records


@pytest.fixture
def tenants(redis: Redis) -> Iterator[Tenants]:
    yield Tenants(redis)


@pytest.fixture
def new_tenant(tenants: Tenants) -> Callable[..., tuple[str, str]]:
    """``new_tenant(*grants)``: a fresh tenant with those grants; ``(name, key)``."""
    counter = iter(range(10_000))

    def make(*grants: str) -> tuple[str, str]:
        name = f"t{time.monotonic_ns()}-{next(counter)}"
        _, key = tenants.create(name, TenantLimits())
        for grant in grants:
            tenants.grant(name, grant)
        return name, key

    return make


def _client(gateway_url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=gateway_url, headers=auth_headers(key), timeout=30)


def _job_count(redis: Redis) -> int:
    return job_records(redis)


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Basic dXNlcjpwYXNz"},
        {"Authorization": "Bearer"},
        {"Authorization": "Bearer not-a-key"},
        {"Authorization": "Bearer lf_000000000000_wrongsecret"},
    ],
)
def test_missing_or_bad_key_is_401_everywhere_but_health(
    gateway_url: str, headers: dict[str, str], redis: Redis
) -> None:
    before = _job_count(redis)
    with httpx.Client(base_url=gateway_url, headers=headers) as http:
        for method, path in [
            ("POST", "/v1/jobs"),
            ("GET", "/v1/jobs/abc"),
            ("DELETE", "/v1/jobs/abc"),
            ("GET", "/v1/models"),
            ("POST", "/v1/completions"),
            ("POST", "/v1/chat/completions"),
        ]:
            body = {"adapter": "lora-00-r8-qv", "prompt": "hi"} if method == "POST" else None
            response = http.request(method, path, json=body)
            assert response.status_code == 401, (method, path, response.text)
            error = response.json()["error"]
            assert error["code"] == "unauthorized"
            assert "Authorization: Bearer" in error["message"]
            assert response.headers["WWW-Authenticate"] == "Bearer"
        assert http.get("/healthz").status_code == 200
        assert http.get("/readyz").status_code == 200
    assert _job_count(redis) == before


def test_revoked_key_is_refused_and_rotation_ends_the_old_key(
    gateway_url: str, tenants: Tenants, new_tenant: Callable[..., tuple[str, str]]
) -> None:
    name, key = new_tenant()
    (listed,) = tenants.keys(name)
    assert key.startswith(listed.prefix.rstrip("…")) and listed.prefix != key
    with _client(gateway_url, key) as http:
        assert http.get("/v1/models").status_code == 200

    rotated_record, rotated = tenants.rotate(name, listed.key_id)
    with _client(gateway_url, key) as http:
        assert http.get("/v1/models").status_code == 401
    with _client(gateway_url, rotated) as http:
        assert http.get("/v1/models").status_code == 200

    tenants.revoke(name, rotated_record.key_id)
    with _client(gateway_url, rotated) as http:
        assert http.get("/v1/models").status_code == 401
    assert tenants.keys(name) == []


def test_rotation_with_grace_keeps_both_keys_until_it_ends(
    gateway_url: str, tenants: Tenants, new_tenant: Callable[..., tuple[str, str]]
) -> None:
    name, old = new_tenant()
    (listed,) = tenants.keys(name)
    # Long enough for both keys to be used on a stalled machine before it ends.
    _, new = tenants.rotate(name, listed.key_id, grace_s=8)
    with _client(gateway_url, old) as old_http, _client(gateway_url, new) as new_http:
        assert old_http.get("/v1/models").status_code == 200
        assert new_http.get("/v1/models").status_code == 200
        ending = next(k for k in tenants.keys(name) if k.key_id == listed.key_id)
        assert ending.expires_at is not None
        deadline = time.monotonic() + 60
        while old_http.get("/v1/models").status_code == 200:
            assert time.monotonic() < deadline, "the rotated key never stopped working"
            time.sleep(0.2)
        assert old_http.get("/v1/models").json()["error"]["code"] == "unauthorized"
        assert new_http.get("/v1/models").status_code == 200


def test_ungranted_adapter_answers_exactly_like_a_missing_one(
    gateway_url: str,
    redis: Redis,
    published: dict[str, AdapterRecord],
    new_tenant: Callable[..., tuple[str, str]],
) -> None:
    granted, ungranted = sorted(published)[:2]
    _, key = new_tenant(granted)
    before = _job_count(redis)
    with _client(gateway_url, key) as http:
        refused = http.post("/v1/jobs", json={"adapter": ungranted, "prompt": "hi"})
        missing = http.post("/v1/jobs", json={"adapter": "no-such-adapter", "prompt": "hi"})
        assert refused.status_code == missing.status_code == 404
        assert refused.json() == {
            "error": {
                **missing.json()["error"],
                "message": missing.json()["error"]["message"].replace("no-such-adapter", ungranted),
            }
        }
        assert refused.headers.keys() == missing.headers.keys()
        assert _job_count(redis) == before
        assert http.post("/v1/jobs", json={"adapter": granted, "prompt": "hi"}).status_code == 202
        models = [model["id"] for model in http.get("/v1/models").json()["data"]]
        assert models == [granted]
        assert http.get(f"/v1/models/{ungranted}").status_code == 404


def test_a_channel_grant_follows_the_channel_not_the_alias_behind_it(
    gateway_url: str,
    redis: Redis,
    published: dict[str, AdapterRecord],
    new_tenant: Callable[..., tuple[str, str]],
) -> None:
    alias = sorted(published)[2]
    channel = f"ch-{time.monotonic_ns()}"
    Registry(redis).set_channel(channel, alias)
    _, key = new_tenant(channel)
    with _client(gateway_url, key) as http:
        accepted = http.post("/v1/jobs", json={"adapter": channel, "prompt": "hi"})
        assert accepted.status_code == 202
        assert accepted.json()["channel"] == channel and accepted.json()["adapter"] == alias
        by_alias = http.post("/v1/jobs", json={"adapter": alias, "prompt": "hi"})
        assert by_alias.status_code == 404
        assert by_alias.json()["error"]["code"] == "adapter_not_found"
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [channel]


def test_another_tenants_job_is_404_like_a_job_that_never_existed(
    gateway_url: str,
    api: httpx.Client,
    published: dict[str, AdapterRecord],
    new_tenant: Callable[..., tuple[str, str]],
) -> None:
    own = api.post("/v1/jobs", json={"adapter": sorted(published)[0], "prompt": "mine"})
    assert own.status_code == 202
    job_id = own.json()["id"]
    never = "f" * 32
    _, key = new_tenant("*")
    with _client(gateway_url, key) as http:
        for method in ("GET", "DELETE"):
            theirs = http.request(method, f"/v1/jobs/{job_id}")
            missing = http.request(method, f"/v1/jobs/{never}")
            assert theirs.status_code == missing.status_code == 404
            assert theirs.json()["error"]["code"] == "job_not_found"
            assert (
                theirs.json()["error"]["message"].replace(job_id, never)
                == (missing.json()["error"]["message"])
            )
    # The owner still sees it, and it was not cancelled by the other tenant's DELETE.
    assert api.get(f"/v1/jobs/{job_id}").json()["status"] != "cancelled"


def test_records_are_parsed_once_per_content_yet_every_change_applies_on_the_next_check(
    redis: Redis, tenants: Tenants, new_tenant: Callable[..., tuple[str, str]], infra: LocalStack
) -> None:
    """The key check reads the key and tenant records from Redis on every request; what it
    keeps is only their parse, by their exact text: the same records are parsed once, a
    changed tenant record is parsed anew on the next request, and a revoked key is refused
    there even though its record's parse is kept."""
    name, key = new_tenant()
    caller = Caller(key_hash(key))

    async def checked() -> Access:
        client = AsyncRedis.from_url(infra.redis_url, decode_responses=True)
        try:
            return await access.check(client, caller)
        finally:
            await client.aclose()

    first = asyncio.run(checked())
    parsed = access.parsed_records()
    assert asyncio.run(checked()) == first
    assert access.parsed_records() == parsed  # the same text: nothing parsed again

    tenants.set_limits(name, TenantLimits(max_concurrent=7))
    assert asyncio.run(checked()).tenant.limits.max_concurrent == 7
    assert access.parsed_records() == parsed + 1  # the tenant's new record

    (listed,) = tenants.keys(name)
    tenants.revoke(name, listed.key_id)
    with pytest.raises(ApiError) as refused:
        asyncio.run(checked())
    assert refused.value.status_code == 401
