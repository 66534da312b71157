"""A recalled access (``gateway.access.recall``): an admission whose caller's access this
gateway read before reads none, and the admission script checks it; every change still
applies on the next request, and a key that no longer holds is 401 whatever the body holds.
Through HTTP against a gateway with real Redis; the commands it sends are watched with
``MONITOR``."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis import Redis

from contracts import admission
from contracts.errors import ErrorCode
from contracts.keys import api_key_key, tenant_key
from contracts.registry import AdapterRecord, BaseModelRef
from contracts.tenants import ApiKeyRecord, TenantLimits, key_hash
from gateway.access import ACCESS
from lorafleet.client import auth_headers
from lorafleet.registry import Registry
from lorafleet.tenants import Tenants
from tests.gateway.conftest import PRIVATE_DB, admitted_state

GatewayAs = Callable[[str], AbstractContextManager[httpx.Client]]
"""``gateway_as``: a gateway and a client of it presenting a key."""
Change = Callable[[Redis, str, str, dict[str, AdapterRecord]], None]
"""A change to what decides an access: ``(redis, tenant, alias, published)``."""

ACCESS_SHA = hashlib.sha1(ACCESS.encode()).hexdigest()
ADMIT_SHA = hashlib.sha1(admission.ADMIT.encode()).hexdigest()


def _job(adapter: str, prompt: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"adapter": adapter, "prompt": prompt, "sampling": {"max_tokens": 4}, **extra}


@contextmanager
def _scripts_called(redis: Redis) -> Iterator[list[str]]:
    """The access and admission scripts run on the private database while the block runs, by
    SHA (``MONITOR`` sees every database; only ``PRIVATE_DB``'s are kept)."""
    called: list[str] = []
    ready, stop = threading.Event(), threading.Event()

    def watch() -> None:
        with redis.monitor() as monitor:
            ready.set()
            for command in monitor.listen():
                words = command["command"].split()
                ours = words[0] == "EVALSHA" and words[1] in (ACCESS_SHA, ADMIT_SHA)
                if ours and command["db"] == PRIVATE_DB:
                    called.append(words[1])
                if stop.is_set() and "lorafleet:monitor-end" in command["command"]:
                    return

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    assert ready.wait(10)
    redis.ping()  # the monitor's connection is subscribed once a command goes by
    try:
        yield called
    finally:
        stop.set()
        redis.get("lorafleet:monitor-end")  # seen by the monitor after everything before it
        thread.join(10)
        assert not thread.is_alive(), "MONITOR did not see the end marker"


def _recalls(http: httpx.Client) -> dict[str, float]:
    families = text_string_to_metric_families(http.get("/metrics").text)
    return {"held": 0.0, "changed": 0.0} | {
        sample.labels["outcome"]: sample.value
        for family in families
        if family.name == "lorafleet_access_recalls"
        for sample in family.samples
        if sample.name.endswith("_total")
    }


@pytest.fixture
def gateway_as(
    private_gateway: Callable[..., Any],
) -> GatewayAs:
    """``gateway_as(key)``: a gateway on the private database (its metrics public) and a
    client of it presenting ``key``."""

    @contextmanager
    def serve(key: str) -> Iterator[httpx.Client]:
        with (
            private_gateway(metrics_public=True) as url,
            httpx.Client(base_url=url, headers=auth_headers(key), timeout=60) as http,
        ):
            yield http

    return serve


@pytest.fixture
def acme(
    tenant: Callable[..., tuple[str, str]], published: dict[str, AdapterRecord]
) -> tuple[str, str, str]:
    """Tenant ``acme``, granted the first adapter published: ``(name, key, alias)``."""
    alias = sorted(published)[0]
    name, key = tenant("acme", alias)
    return name, key, alias


@pytest.fixture
def tenant(private_redis: Redis) -> Callable[..., tuple[str, str]]:
    """``tenant(name, *grants)``: a new tenant with those grants; ``(name, key)``."""

    def make(name: str, *grants: str) -> tuple[str, str]:
        tenants = Tenants(private_redis)
        _, key = tenants.create(name, TenantLimits())
        for grant in grants:
            tenants.grant(name, grant)
        return name, key

    return make


def test_a_second_admission_reads_no_access_and_its_admission_checks_the_recalled_one(
    gateway_as: GatewayAs,
    acme: tuple[str, str, str],
    private_redis: Redis,
) -> None:
    _, key, alias = acme
    for script in (ACCESS, admission.ADMIT):  # each EVALSHA then runs at once (no NOSCRIPT)
        private_redis.script_load(script)
    with gateway_as(key) as http:
        with _scripts_called(private_redis) as first:
            assert http.post("/v1/jobs", json=_job(alias)).status_code == 202
        with _scripts_called(private_redis) as then:
            for _ in range(3):
                assert http.post("/v1/jobs", json=_job(alias)).status_code == 202
        assert first == [ACCESS_SHA, ADMIT_SHA]
        assert then == [ADMIT_SHA] * 3  # one round trip a job: no access read
        assert _recalls(http) == {"held": 3.0, "changed": 0.0}
        assert admitted_state(private_redis, "acme")["records"] == 4


def _revoke_key(redis: Redis, tenant: str, _: str, __: dict[str, AdapterRecord]) -> None:
    tenants = Tenants(redis)
    (listed,) = tenants.keys(tenant)
    tenants.revoke(tenant, listed.key_id)


def _revoke_grant(redis: Redis, tenant: str, alias: str, _: dict[str, AdapterRecord]) -> None:
    assert Tenants(redis).revoke_grant(tenant, alias)


def _retire(redis: Redis, _: str, alias: str, __: dict[str, AdapterRecord]) -> None:
    Registry(redis).retire(alias)


def _delete_tenant_record(redis: Redis, tenant: str, _: str, __: dict[str, AdapterRecord]) -> None:
    redis.delete(tenant_key(tenant))


@pytest.mark.parametrize(
    ("change", "status", "code"),
    [
        (_revoke_key, 401, ErrorCode.UNAUTHORIZED),
        (_delete_tenant_record, 401, ErrorCode.UNAUTHORIZED),
        (_revoke_grant, 404, ErrorCode.ADAPTER_NOT_FOUND),
        (_retire, 410, ErrorCode.ADAPTER_RETIRED),
    ],
    ids=["key revoked", "tenant gone", "grant revoked", "alias retired"],
)
def test_a_change_to_a_recalled_access_refuses_the_next_request_and_writes_nothing(
    gateway_as: GatewayAs,
    tenant: Callable[..., tuple[str, str]],
    private_redis: Redis,
    published: dict[str, AdapterRecord],
    change: Change,
    status: int,
    code: ErrorCode,
) -> None:
    alias = sorted(published)[1]
    name, key = tenant("acme", alias)
    with gateway_as(key) as http:
        assert http.post("/v1/jobs", json=_job(alias)).status_code == 202  # read
        assert http.post("/v1/jobs", json=_job(alias)).status_code == 202  # recalled: held
        before = admitted_state(private_redis, name)
        change(private_redis, name, alias, published)
        refused = http.post("/v1/jobs", json=_job(alias))
        assert refused.status_code == status, refused.text
        assert refused.json()["error"]["code"] == code.value
        assert admitted_state(private_redis, name) == before
        recalls = _recalls(http)
        assert recalls == {"held": 1.0, "changed": 1.0}, recalls


def test_a_moved_channel_and_new_limits_apply_on_the_next_request_read_again(
    gateway_as: GatewayAs,
    tenant: Callable[..., tuple[str, str]],
    private_redis: Redis,
    published: dict[str, AdapterRecord],
) -> None:
    first, second = sorted(published)[:2]
    registry, tenants = Registry(private_redis), Tenants(private_redis)
    registry.set_channel("prod", first)
    name, key = tenant("acme", "prod")
    with gateway_as(key) as http:
        for _ in range(2):
            accepted = http.post("/v1/jobs", json=_job("prod", deadline_s=600))
            assert accepted.status_code == 202 and accepted.json()["adapter"] == first
        registry.set_channel("prod", second)
        idempotent = {"Idempotency-Key": "after-the-move"}
        moved = http.post("/v1/jobs", json=_job("prod", deadline_s=600), headers=idempotent)
        assert moved.status_code == 202 and moved.json()["adapter"] == second
        assert moved.json()["revision"] == published[second].digest
        # Its idempotency key was reserved, freed by the refused first try, and taken again:
        # the replay answers the job that was admitted, the only one.
        replay = http.post("/v1/jobs", json=_job("prod", deadline_s=600), headers=idempotent)
        assert replay.status_code == 200 and replay.json()["id"] == moved.json()["id"]
        assert admitted_state(private_redis, name)["records"] == 3
        assert _recalls(http) == {"held": 1.0, "changed": 1.0}

        tenants.set_limits(name, TenantLimits(max_concurrent=3))
        refused = http.post("/v1/jobs", json=_job("prod"))
        assert refused.status_code == 429, refused.text
        assert "may hold 3 unfinished jobs" in refused.json()["error"]["message"]
        assert admitted_state(private_redis, name)["records"] == 3
        assert _recalls(http) == {"held": 1.0, "changed": 2.0}


def test_a_rotated_key_recalled_in_its_grace_is_read_again_and_refused_at_its_end(
    gateway_as: GatewayAs,
    acme: tuple[str, str, str],
    private_redis: Redis,
) -> None:
    name, key, alias = acme
    tenants = Tenants(private_redis)
    with gateway_as(key) as http:
        assert http.post("/v1/jobs", json=_job(alias)).status_code == 202
        (listed,) = tenants.keys(name)
        tenants.rotate(name, listed.key_id, grace_s=3)
        # Redis drops the record at the end of the grace by its own clock; here it outlives
        # its end (its TTL is not part of what an access reads), as it would on a Redis whose
        # clock runs behind the gateway's: the gateway's own check of the end it kept refuses
        # it (the admission would find the record unchanged).
        hashed = api_key_key(key_hash(key))
        assert private_redis.expire(hashed, 120)
        # Its record changed (it now ends): read again, admitted, kept with its end.
        assert http.post("/v1/jobs", json=_job(alias)).status_code == 202
        assert _recalls(http) == {"held": 0.0, "changed": 1.0}
        ending = ApiKeyRecord.model_validate_json(str(private_redis.get(hashed)))
        assert ending.expires_at is not None
        while datetime.now(tz=UTC) < ending.expires_at:
            time.sleep(0.1)
        before = admitted_state(private_redis, name)
        refused = http.post("/v1/jobs", json=_job(alias))
        assert refused.status_code == 401
        assert admitted_state(private_redis, name) == before
        assert _recalls(http) == {"held": 0.0, "changed": 1.0}


INVALID = [
    ("/v1/jobs", {"sampling": {"max_tokens": 0}}),
    ("/v1/jobs", {"prompt": "hello " * 3000}),  # past the context: refused by the route
    ("/v1/jobs", {"deadline_s": 10**9}),
    ("/v1/completions", {"max_tokens": -1}),
    ("/v1/completions", {"n": 2}),
]


def _body(path: str, alias: str, bad: dict[str, Any]) -> dict[str, Any]:
    if path == "/v1/jobs":
        return _job(alias) | bad
    return {"model": alias, "prompt": "hello", "max_tokens": 4} | bad


@pytest.mark.parametrize(("path", "bad"), INVALID, ids=[str(b)[:30] for _, b in INVALID])
def test_a_revoked_key_recalled_is_401_whatever_the_body_holds(
    gateway_as: GatewayAs,
    acme: tuple[str, str, str],
    private_redis: Redis,
    path: str,
    bad: dict[str, Any],
) -> None:
    name, key, alias = acme
    with gateway_as(key) as http:
        good = _body("/v1/jobs", alias, {})
        assert http.post("/v1/jobs", json=good).status_code == 202
        invalid = http.post(path, json=_body(path, alias, bad))
        assert invalid.status_code == 422, invalid.text  # a good key: the body's own error
        (listed,) = Tenants(private_redis).keys(name)
        Tenants(private_redis).revoke(name, listed.key_id)
        before = admitted_state(private_redis, name)
        refused = http.post(path, json=_body(path, alias, bad))
        assert refused.status_code == 401, refused.text
        assert refused.json()["error"]["code"] == "unauthorized"
        assert refused.headers["WWW-Authenticate"] == "Bearer"
        assert admitted_state(private_redis, name) == before


@pytest.mark.parametrize(
    ("change", "status"),
    [(_revoke_key, 401), (_revoke_grant, 404), (_retire, 410)],
    ids=["key revoked", "grant revoked", "alias retired"],
)
def test_an_idempotency_replay_to_a_changed_recalled_access_is_refused_as_a_read_would(
    gateway_as: GatewayAs,
    acme: tuple[str, str, str],
    private_redis: Redis,
    published: dict[str, AdapterRecord],
    change: Change,
    status: int,
) -> None:
    name, key, alias = acme
    idempotent = {"Idempotency-Key": "once"}
    with gateway_as(key) as http:
        first = http.post("/v1/jobs", json=_job(alias), headers=idempotent)
        assert first.status_code == 202
        replay = http.post("/v1/jobs", json=_job(alias), headers=idempotent)
        assert replay.status_code == 200 and replay.json()["id"] == first.json()["id"]
        change(private_redis, name, alias, published)
        refused = http.post("/v1/jobs", json=_job(alias), headers=idempotent)
        assert refused.status_code == status, refused.text
        assert admitted_state(private_redis, name)["records"] == 1


def _refused(http: httpx.Client) -> dict[str, float]:
    families = text_string_to_metric_families(http.get("/metrics").text)
    return {
        sample.labels["code"]: sample.value
        for family in families
        if family.name == "lorafleet_admissions_refused"
        for sample in family.samples
        if sample.name.endswith("_total")
    }


def test_a_recalled_key_refused_is_counted_as_a_read_one_is(
    gateway_as: GatewayAs,
    acme: tuple[str, str, str],
    private_redis: Redis,
) -> None:
    """A revoked key is 401 and counted as no refusal of an admission (as when the key check
    reads it: authentication comes before admission), whether its recalled access was found
    changed by the admission or its request's own error was answered as the 401."""
    name, key, alias = acme
    _, other = Tenants(private_redis).create_key(name)
    too_long = _job(alias, "hello " * 3000)
    with (
        gateway_as(key) as http,
        httpx.Client(base_url=http.base_url, headers=auth_headers(other)) as other_http,
    ):
        assert http.post("/v1/jobs", json=_job(alias)).status_code == 202
        assert other_http.post("/v1/jobs", json=_job(alias)).status_code == 202
        assert http.post("/v1/jobs", json=too_long).status_code == 422  # counted: a good key
        before = _refused(http)
        assert before == {"prompt_too_long": 1.0}
        for listed in Tenants(private_redis).keys(name):
            Tenants(private_redis).revoke(name, listed.key_id)
        assert http.post("/v1/jobs", json=too_long).status_code == 401
        assert other_http.post("/v1/jobs", json=_job(alias)).status_code == 401
        assert _refused(http) == before


@pytest.mark.parametrize(
    ("change", "status"),
    [(_revoke_grant, 404), (_retire, 410)],
    ids=["grant revoked", "alias retired"],
)
def test_a_request_refused_before_its_admission_is_refused_as_a_read_would_refuse_it(
    gateway_as: GatewayAs,
    acme: tuple[str, str, str],
    private_redis: Redis,
    published: dict[str, AdapterRecord],
    change: Change,
    status: int,
) -> None:
    """A prompt too long for the recalled adapter's model, after the name was taken away: a
    read answers the name's refusal first (404, 410), so must a recall."""
    name, key, alias = acme
    with gateway_as(key) as http:
        assert http.post("/v1/jobs", json=_job(alias)).status_code == 202
        change(private_redis, name, alias, published)
        refused = http.post("/v1/jobs", json=_job(alias, "hello " * 3000))
        assert refused.status_code == status, refused.text


def test_a_recalled_adapter_that_moved_is_what_a_request_is_checked_against(
    gateway_as: GatewayAs,
    tenant: Callable[..., tuple[str, str]],
    private_redis: Redis,
    published: dict[str, AdapterRecord],
) -> None:
    """A channel moved to an adapter of another base model: a prompt too long for the old
    model's context is checked against the new one (here a base no worker has described
    yet, so the worker checks it) and admitted, not refused by what was recalled."""
    first = published[sorted(published)[0]]
    other_base = BaseModelRef(id="another/base", digest="sha256:" + "e" * 64)
    moved = first.model_copy(
        update={"alias": "elsewhere", "digest": "sha256:" + "f" * 64, "base_model": other_base}
    )
    registry = Registry(private_redis)
    registry.register(moved)
    registry.set_channel("prod", first.alias)
    _, key = tenant("acme", "prod")
    long_prompt = _job("prod", "hello " * 3000)
    with gateway_as(key) as http:
        assert http.post("/v1/jobs", json=_job("prod")).status_code == 202
        assert http.post("/v1/jobs", json=long_prompt).status_code == 422  # the first's model
        registry.set_channel("prod", "elsewhere")
        accepted = http.post("/v1/jobs", json=long_prompt)
        assert accepted.status_code == 202, accepted.text
        assert accepted.json()["adapter"] == "elsewhere"
        assert accepted.json()["revision"] == moved.digest
