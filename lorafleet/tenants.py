"""Tenant management (CLI side): tenants, their API keys and their grants, stored in Redis.

A key is shown once, when it is created; only its hash is stored. Revoking deletes the hash,
so the gateway refuses the key on its next request. Rotating issues a new key and ends the
old one, at once or after a grace period (the old key's record then expires in Redis).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

from redis import Redis
from redis.exceptions import WatchError

from contracts.errors import ErrorCode
from contracts.keys import (
    ADAPTERS_INDEX,
    CHANNELS_INDEX,
    TENANTS_INDEX,
    api_key_key,
    grants_key,
    tenant_key,
    tenant_keys_key,
    webhook_secrets_key,
)
from contracts.tenants import (
    ALL_ADAPTERS,
    ApiKeyRecord,
    TenantLimits,
    TenantRecord,
    key_hash,
    new_api_key,
)
from contracts.webhooks import SigningSecret, SigningSecrets, new_secret
from lorafleet.registry import RegistryError, check_name


class Tenants:
    def __init__(self, redis: Redis) -> None:
        self._redis = redis

    def create(
        self, name: str, limits: TenantLimits | None = None, operator: bool = False
    ) -> tuple[TenantRecord, str]:
        """A new tenant and its first API key (plaintext: shown once, never stored)."""
        check_name(name, "Tenant")
        record = TenantRecord(
            name=name,
            created_at=datetime.now(tz=UTC),
            limits=limits or TenantLimits(),
            operator=operator,
        )
        if not self._redis.set(tenant_key(name), record.model_dump_json(), nx=True):
            raise RegistryError(ErrorCode.TENANT_EXISTS, f"A tenant named {name!r} exists.")
        self._redis.sadd(TENANTS_INDEX, name)
        _, key = self.create_key(name)
        return record, key

    def get(self, name: str) -> TenantRecord:
        raw = self._redis.get(tenant_key(name))
        if raw is None:
            raise RegistryError(ErrorCode.TENANT_NOT_FOUND, f"No tenant named {name!r} exists.")
        return TenantRecord.model_validate_json(str(raw))

    def all(self) -> list[TenantRecord]:
        names = sorted(str(name) for name in self._redis.smembers(TENANTS_INDEX))  # type: ignore[union-attr]
        return [self.get(name) for name in names]

    def set_limits(self, name: str, limits: TenantLimits) -> TenantRecord:
        """Replace the tenant's own limits (``None`` fields take the gateway's defaults)."""
        record = self.get(name).model_copy(update={"limits": limits})
        self._redis.set(tenant_key(name), record.model_dump_json(), xx=True)
        return record

    def create_key(self, tenant: str) -> tuple[ApiKeyRecord, str]:
        self.get(tenant)
        key_id, key = new_api_key()
        record = ApiKeyRecord(key_id=key_id, tenant=tenant, created_at=datetime.now(tz=UTC))
        hashed = key_hash(key)
        with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(api_key_key(hashed), record.model_dump_json())
            pipe.hset(tenant_keys_key(tenant), key_id, hashed)
            pipe.execute()
        return record, key

    def keys(self, tenant: str) -> list[ApiKeyRecord]:
        """The tenant's live keys (those past a rotation's grace period are dropped)."""
        self.get(tenant)
        hashes: dict[str, str] = self._redis.hgetall(tenant_keys_key(tenant))  # type: ignore[assignment]
        records = []
        for key_id, hashed in sorted(hashes.items()):
            raw = self._redis.get(api_key_key(hashed))
            if raw is None:
                self._redis.hdel(tenant_keys_key(tenant), key_id)
                continue
            records.append(ApiKeyRecord.model_validate_json(str(raw)))
        return records

    def _hash_of(self, tenant: str, key_id: str) -> str:
        self.get(tenant)
        hashed = self._redis.hget(tenant_keys_key(tenant), key_id)
        if hashed is None or not self._redis.exists(api_key_key(str(hashed))):
            raise RegistryError(
                ErrorCode.KEY_NOT_FOUND, f"Tenant {tenant!r} has no live key {key_id!r}."
            )
        return str(hashed)

    def revoke(self, tenant: str, key_id: str) -> None:
        """The key stops working on the gateway's next request."""
        hashed = self._hash_of(tenant, key_id)
        with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(api_key_key(hashed))
            pipe.hdel(tenant_keys_key(tenant), key_id)
            pipe.execute()

    def rotate(self, tenant: str, key_id: str, grace_s: int = 0) -> tuple[ApiKeyRecord, str]:
        """A new key; the old one ends now (``grace_s == 0``) or after ``grace_s`` seconds."""
        hashed = self._hash_of(tenant, key_id)
        if grace_s <= 0:
            record, key = self.create_key(tenant)
            self.revoke(tenant, key_id)
            return record, key
        raw = self._redis.get(api_key_key(hashed))
        old = ApiKeyRecord.model_validate_json(str(raw))
        ending = old.model_copy(
            update={"expires_at": datetime.now(tz=UTC) + timedelta(seconds=grace_s)}
        )
        record, key = self.create_key(tenant)
        self._redis.set(api_key_key(hashed), ending.model_dump_json(), ex=grace_s)
        return record, key

    def grant(self, tenant: str, name: str) -> None:
        """Let ``tenant`` use alias or channel ``name`` (``*``: every one, now and later)."""
        self.get(tenant)
        if name != ALL_ADAPTERS:
            check_name(name, "Adapter or channel")
            known = self._redis.sismember(ADAPTERS_INDEX, name)
            if not known and not self._redis.sismember(CHANNELS_INDEX, name):
                raise RegistryError(
                    ErrorCode.ADAPTER_NOT_FOUND, f"No adapter or channel named {name!r}."
                )
        self._redis.sadd(grants_key(tenant), name)

    def revoke_grant(self, tenant: str, name: str) -> bool:
        """Takes effect on the next admission; jobs already admitted still run."""
        self.get(tenant)
        return bool(self._redis.srem(grants_key(tenant), name))

    def grants(self, tenant: str) -> list[str]:
        self.get(tenant)
        return sorted(str(name) for name in self._redis.smembers(grants_key(tenant)))  # type: ignore[union-attr]

    def webhook_secrets(
        self, tenant: str, rotate: bool = False, grace_s: float = 24 * 3600
    ) -> SigningSecrets:
        """The tenant's signing secrets (created on first use), newest first. Rotating adds a
        new one; the others keep signing until ``grace_s`` has passed, so receivers can
        switch over while both signatures arrive."""
        self.get(tenant)
        key = webhook_secrets_key(tenant)
        with self._redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(key)
                    raw = pipe.get(key)
                    now = time.time()
                    current = (
                        SigningSecrets.model_validate_json(str(raw)) if raw is not None else None
                    )
                    if current is not None and not rotate:
                        return current
                    fresh = (
                        current.rotated(now, grace_s)
                        if current is not None
                        else SigningSecrets(secrets=[SigningSecret(secret=new_secret())])
                    )
                    pipe.multi()
                    pipe.set(key, fresh.model_dump_json())
                    pipe.execute()
                    return fresh
                except WatchError:
                    continue
